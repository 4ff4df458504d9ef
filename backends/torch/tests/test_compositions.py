"""Several optimizers and several models in one process, side by side with what users run natively.

- pytorch/examples dcgan/main.py (netD/netG, two Adam optimizers, BCELoss) with one
  ``torch.amp.GradScaler`` as torch's AMP examples add it ("Working with Multiple Models, Losses,
  and Optimizers": ``step(opt_d); step(opt_g); update()``): unimp equal bit for bit;
- one model, two optimizers (body and head: issue 32), masters per optimizer, exact resume;
- an optimizer unimp does not wrap, refused at its first step (never a scaled or lost update);
- Lightning manual optimization with two optimizers, against Lightning's own mixed precision;
- a frozen teacher beside a trained student, a policy model beside its frozen reference (TRL
  style), an EMA of the fp32 masters (``torch.optim.swa_utils.AveragedModel``, built after or before
  ``apply``, against an fp32 run's EMA);
- ``amp.watch()`` over several optimizers (DCGAN's two Amps sharing one scale, one Amp's body and head
  optimizers with ``amp.update()``): one record per iteration, as a GradScaler run side by side.
"""

import copy
from typing import Any

import pytest
import torch
from models import train_steps
from torch import nn

import unimp
from unimp.errors import UnsupportedError

NZ, NGF, NDF, NC = 8, 8, 8, 3


def dcgan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """pytorch/examples dcgan/main.py's Generator and Discriminator, scaled to 16x16 images (three layers each)."""
    torch.manual_seed(seed)
    net_g = nn.Sequential(
        nn.ConvTranspose2d(NZ, NGF * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(NGF * 2), nn.ReLU(True),
        nn.ConvTranspose2d(NGF * 2, NGF, 4, 2, 1, bias=False), nn.BatchNorm2d(NGF), nn.ReLU(True),
        nn.ConvTranspose2d(NGF, NC, 4, 2, 1, bias=False), nn.Tanh())
    net_d = nn.Sequential(
        nn.Conv2d(NC, NDF, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF, NDF * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(NDF * 2), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(NDF * 2, 1, 4, 1, 0, bias=False), nn.Sigmoid())
    for m in (*net_g.modules(), *net_d.modules()):  # dcgan/main.py's weights_init
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.normal_(m.weight, 0.0, 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)
    return net_d, net_g


def adam(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(net.parameters(), lr=2e-4, betas=(0.5, 0.999))


def batches(steps: int, b: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.rand(b, NC, 16, 16, generator=g) * 2 - 1, torch.randn(b, NZ, 1, 1, generator=g))
            for _ in range(steps)]


def params_of(*nets: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for n in nets for p in n.state_dict().values()]


# grows every good iteration: overflows and skips happen, among them an iteration where D skips and G steps
SCALE = {"initial": 2.0 ** 13, "growth_interval": 1}


class _Amplified(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by 1e9 in its dtype (float16: inf past 65504)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e9


class Overflow:
    """A backward overflow planted in the discriminator: at iteration ``at``, the first forward of layer ``path``
    (on the real batch) returns its output through :class:`_Amplified`, so the gradient reaching the layer's
    own backward overflows float16: D's gradients are not finite, G's (from later forwards) are. (A forward
    overflow would reach BCELoss as NaN, which refuses it.) ``next()`` starts an iteration."""

    def __init__(self, net_d: nn.Module, at: int, path: str = "2") -> None:
        self.at, self.iteration, self.calls = at, -1, 0
        net_d.get_submodule(path).register_forward_hook(self)  # before any watch's hooks: they see its output

    def next(self) -> None:
        self.iteration, self.calls = self.iteration + 1, 0

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        return _Amplified.apply(out) if self.iteration == self.at and self.calls == 1 else None


def dcgan_native(data, scale=SCALE, overflow_at=None):
    """dcgan/main.py's loop with torch.autocast("cpu", float16) and one GradScaler (torch's AMP recipe)."""
    net_d, net_g = dcgan()
    planted = Overflow(net_d, overflow_at) if overflow_at is not None else None
    net_d, net_g = (n.to(memory_format=torch.channels_last) for n in (net_d, net_g))  # as the preset's layout
    opt_d, opt_g = adam(net_d), adam(net_g)
    criterion = nn.BCELoss()
    scaler = torch.amp.GradScaler("cpu", init_scale=scale["initial"], growth_interval=scale["growth_interval"])
    trace = []
    for real, noise in data:
        if planted is not None:
            planted.next()
        real = real.to(memory_format=torch.channels_last)
        net_d.zero_grad()
        with torch.autocast("cpu", torch.float16):
            output = net_d(real).view(-1)
            err_d_real = criterion(output, torch.ones_like(output, dtype=torch.float32))
        scaler.scale(err_d_real).backward()
        with torch.autocast("cpu", torch.float16):
            fake = net_g(noise)
            output = net_d(fake.detach()).view(-1)
            err_d_fake = criterion(output, torch.zeros_like(output, dtype=torch.float32))
        scaler.scale(err_d_fake).backward()
        before_d = weights(net_d)
        scaler.step(opt_d)
        net_g.zero_grad()
        with torch.autocast("cpu", torch.float16):
            output = net_d(fake).view(-1)
            err_g = criterion(output, torch.ones_like(output, dtype=torch.float32))
        scaler.scale(err_g).backward()
        before_g = weights(net_g)
        scaler.step(opt_g)
        scaler.update()
        trace.append((scaler.get_scale(), _moved(before_d, net_d), _moved(before_g, net_g)))
    return params_of(net_d, net_g), trace


def weights(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _moved(before: list[torch.Tensor], net: nn.Module) -> bool:
    """Whether the optimizer step changed the net's parameters (Adam on nonzero grads always does)."""
    return any(not torch.equal(a, b) for a, b in zip(before, weights(net), strict=True))


def dcgan_unimp(data, scale=SCALE, preset="mixed_fp16", overflow_at=None, watches=None, **watch):
    """The same loop under unimp: each net its own Amp, one loss scale shared (share_scale_with). ``watches``: a
    list that gets ``amp_d.watch(**watch)`` and ``amp_g.watch(**watch)``."""
    net_d, net_g = dcgan()
    planted = Overflow(net_d, overflow_at) if overflow_at is not None else None
    opt_d, opt_g = adam(net_d), adam(net_g)
    policy = {"extends": preset, "loss_scale": scale}
    amp_d = unimp.apply(policy, net_d, opt_d)
    amp_g = unimp.apply(policy, net_g, opt_g, share_scale_with=amp_d)
    if watches is not None:
        watches += [amp_d.watch(**watch), amp_g.watch(**watch)]
    criterion = nn.BCELoss()
    trace = []
    for real, noise in data:
        if planted is not None:
            planted.next()
        net_d.zero_grad()
        output = net_d(real).view(-1).float()  # the loss in float32, as autocast runs BCELoss
        amp_d.backward(criterion(output, torch.ones_like(output)))
        fake = net_g(noise)
        output = net_d(fake.detach()).view(-1).float()
        amp_d.backward(criterion(output, torch.zeros_like(output)))
        before_d = weights(net_d)
        amp_d.optimizer.step()
        net_g.zero_grad()
        output = net_d(fake).view(-1).float()
        amp_g.backward(criterion(output, torch.ones_like(output)))
        before_g = weights(net_g)
        amp_g.optimizer.step()  # the last optimizer of the iteration: the one update
        trace.append((amp_d.scale, _moved(before_d, net_d), _moved(before_g, net_g)))
    assert amp_g.scale == amp_d.scale
    amp_g.remove(), amp_d.remove()
    return params_of(net_d, net_g), trace


def test_dcgan_two_optimizers_one_scale_matches_gradscaler_bitwise():
    """Two models, two Adams, one loss scale: every parameter, scale and skip decision equal to
    autocast + one GradScaler, over steps where D alone, G alone or both overflow."""
    data = batches(8)
    native, native_trace = dcgan_native(data)
    ours, our_trace = dcgan_unimp(data)
    assert our_trace == native_trace
    stepped = {(d, g) for _, d, g in native_trace}
    assert {(True, True), (False, False), (False, True)} <= stepped, native_trace  # one optimizer skips alone
    assert all(torch.equal(a, b) for a, b in zip(ours, native, strict=True))


def expected_records(scales: list[float], every: int) -> list[tuple[int, float, bool, bool]]:
    """What a watch must record, from a native GradScaler's scale after each iteration: ``(step, scale the
    iteration's losses were scaled by, skipped, sampled)`` for each iteration sampled (every ``every``-th from
    the first) or skipped (the scale backed off)."""
    before = [SCALE["initial"], *scales[:-1]]
    return [(i, used, after < used, i % every == 0) for i, (used, after) in enumerate(zip(before, scales, strict=True))
            if i % every == 0 or after < used]


def test_dcgan_watch_records_one_step_per_iteration_of_the_shared_scale():
    """amp.watch() on both DCGAN Amps (netD's optimizer steps first, netG's last and updates the shared scale):
    one record per iteration, sampled by iteration count (every=2) or skipped, none lost or doubled; each
    record's step, scale and skipped as torch.amp.GradScaler's run side by side (the same planted overflow:
    skipped = the native scale backed off); the planted iteration located at the planted layer of netD in the
    backward, and netG's record of it says netD's optimizer skipped (netG's stepped)."""
    data, at = batches(8), 5
    _, native = dcgan_native(data, overflow_at=at)
    watches = []
    _, ours = dcgan_unimp(data, overflow_at=at, watches=watches, every=2, localize=True)
    assert ours == native  # the scale and each optimizer's step or skip, iteration by iteration
    assert native[at][1:] == (False, True)  # the planted overflow: D skipped, G stepped (both natively)
    expected = expected_records([scale for scale, _, _ in native], every=2)
    assert len(expected) > len(data) // 2  # some unsampled iterations were skipped
    for watch in watches:
        assert [(r["step"], r["scale"], r["skipped"], r["sampled"]) for r in watch.records] == expected
    planted_d, planted_g = ({r["step"]: r for r in w.records}[at] for w in watches)
    # the amplified gradient enters layer 2's own backward: its weight gradient is the first non-finite value
    assert planted_d["first_nonfinite"] == {"path": "2", "direction": "backward", "tensor": "grad_param",
                                           "exact": True}
    assert planted_g["first_nonfinite"] is None  # netG's layers saw no non-finite value ...
    assert "another optimizer sharing the loss scale had non-finite gradients (Adam of 0.weight)" in \
        planted_g["notes"][0]  # ... and its record names the optimizer that skipped
    assert all(r["layers"] for w in watches for r in w.records if r["sampled"])


def critic_loss(out: torch.Tensor) -> torch.Tensor:
    """WGAN's critic loss on one forward of [real; fake] (one forward: autocast's weight-cast cache, shared by
    two forwards in one autocast region, would sum their weight gradients in float16 natively)."""
    real, fake = out.float().view(-1).chunk(2)
    return real.mean() - fake.mean()


def test_gan_critic_stepped_twice_per_generator_step_needs_amp_update():
    """A critic stepped twice per generator step (WGAN's n_critic): the second critic step before the shared
    scale's update is refused naming amp.update(); with amp.update() after each step, as GradScaler's
    step(); update() per optimizer step, every parameter and scale equals native bit for bit."""
    data = batches(6)

    def run(native: bool) -> tuple[list[torch.Tensor], list[float]]:
        net_d, net_g = dcgan()
        if native:
            net_d, net_g = (n.to(memory_format=torch.channels_last) for n in (net_d, net_g))
        opt_d, opt_g = adam(net_d), adam(net_g)
        policy = {"extends": "mixed_fp16", "loss_scale": SCALE}
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE["initial"], growth_interval=1)
        amp_d = None if native else unimp.apply(policy, net_d, opt_d)
        amp_g = None if native else unimp.apply(policy, net_g, opt_g, share_scale_with=amp_d)
        scales = []

        def step(net, opt, amp, loss_of):
            net.zero_grad()
            if native:
                with torch.autocast("cpu", torch.float16):
                    loss = loss_of()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                amp.backward(loss_of())
                amp.optimizer.step()
                amp.update()
                scales.append(amp.scale)

        def cl(x):
            return x.to(memory_format=torch.channels_last) if native else x

        for i, (real, noise) in enumerate(data):
            step(net_d, opt_d, amp_d, lambda real=real, noise=noise: critic_loss(net_d(cl(torch.cat(
                [real, net_g(noise).detach()])))))
            if i % 2 == 1:  # the generator every second critic step
                step(net_g, opt_g, amp_g, lambda noise=noise: -net_d(net_g(noise)).float().mean())
        if not native:
            amp_g.remove(), amp_d.remove()
        return params_of(net_d, net_g), scales

    native, native_scales = run(True)
    ours, our_scales = run(False)
    assert our_scales == native_scales
    assert all(torch.equal(a, b) for a, b in zip(ours, native, strict=True))

    net_d, net_g = dcgan()
    amp_d = unimp.apply("mixed_fp16", net_d, adam(net_d))
    amp_g = unimp.apply("mixed_fp16", net_g, adam(net_g), share_scale_with=amp_d)
    real, noise = data[0]
    for attempt in range(2):
        amp_d.backward(critic_loss(net_d(torch.cat([real, net_g(noise).detach()]))))
        if attempt == 0:
            amp_d.optimizer.step()
            with pytest.raises(UnsupportedError, match=r"1 of the 2 optimizers sharing the loss scale stepped.*save"):
                amp_d.state_dict()  # mid-iteration: the update the flag waits for is not in the state
    before = weights(net_d)
    with pytest.raises(UnsupportedError, match=r"already stepped since the last loss-scale update.*amp.update\(\)"):
        amp_d.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, weights(net_d), strict=True))
    amp_g.remove(), amp_d.remove()


# ---------------------------------------------------------------- one model, several optimizers (issue 32)
B, D_IN, HIDDEN, CLASSES = 8, 16, 32, 4


def body_and_head(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def two_sgds(model: nn.Module) -> list[torch.optim.Optimizer]:
    """The body's optimizer and the head's (another learning rate and momentum), as issue 32 has them."""
    return [torch.optim.SGD(model[:4].parameters(), lr=0.1), torch.optim.SGD(model[4].parameters(), lr=0.3,
                                                                              momentum=0.9)]


def mlp_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(B, D_IN, generator=g), torch.randint(0, CLASSES, (B,), generator=g)) for _ in range(steps)]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), y)


def train(model: nn.Module, amp: unimp.Amp, data) -> None:
    """The training loop with every optimizer of the Amp: zero_grad, amp.backward(loss), each one's step."""
    for x, y in data:
        for o in amp.optimizers:
            o.zero_grad()
        amp.backward(loss_fn(model(x), y))
        for o in amp.optimizers:
            o.step()


def fp32_updates(data) -> list[torch.Tensor]:
    """The fp32 reference: the same model, data and two optimizers, no mixed precision."""
    model = body_and_head()
    opts = two_sgds(model)
    before = params_of(model)
    for x, y in data:
        for o in opts:
            o.zero_grad()
        loss_fn(model(x), y).backward()
        for o in opts:
            o.step()
    return [a - b for a, b in zip(params_of(model), before, strict=True)]


def unit_roundoff(preset: str) -> float:
    return {"mixed_fp16": 2.0 ** -11, "fp16_master": 2.0 ** -11, "pure_bf16": 2.0 ** -8}[preset]


def rel_errors(updates: list[torch.Tensor], reference: list[torch.Tensor]) -> list[float]:
    return [float((u.double() - r.double()).norm() / r.double().norm()) for u, r in zip(updates, reference,
                                                                                          strict=True)]


# the worst-case bound of a length-K dot product in a low-precision dtype (Higham's gamma_K ~ K u), K the
# longest reduction (the hidden width), plus one rounding of the stored low-precision weights and one of the output
def update_tolerance(preset: str) -> float:
    return (HIDDEN + 2) * unit_roundoff(preset)


def test_watch_one_model_two_optimizers_head_first_body_every_second_iteration_then_amp_update():
    """One Amp, ``amp.optimizers`` = [body, head]: the head steps first every iteration, the body every second
    one, ``amp.update()`` ends each iteration (GradScaler's ``step(head); step(body); update()``). The watch
    records each iteration once (sampled every 3 or skipped) with the step, scale and skip of a native
    autocast + GradScaler run side by side; the planted overflow in the body's backward (an even iteration,
    not sampled) is located at the planted layer, from either optimizer's flags."""
    data, at = mlp_batches(8), 4

    def run(native: bool) -> tuple[list[float], Any]:
        model = body_and_head()
        overflow = Overflow(model, at, path="2")
        body, head = two_sgds(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE["initial"], growth_interval=1)
        amp = None if native else unimp.apply({"extends": "mixed_fp16", "loss_scale": SCALE}, model, [body, head])
        watch = None if native else amp.watch(every=3, localize=True)
        scales = []
        for i, (x, y) in enumerate(data):
            overflow.next()
            model.zero_grad()
            if native:
                with torch.autocast("cpu", torch.float16):
                    loss = loss_fn(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(head)
                if i % 2 == 0:
                    scaler.step(body)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                amp.backward(loss_fn(model(x), y))
                amp.optimizers[1].step()
                if i % 2 == 0:
                    amp.optimizers[0].step()
                amp.update()
                scales.append(amp.scale)
        if amp is not None:
            amp.remove()
        return scales, watch

    native, _ = run(True)
    ours, watch = run(False)
    assert ours == native
    expected = expected_records(native, every=3)
    assert (at, native[at - 1], True, False) in expected  # the planted iteration: skipped natively, not sampled
    assert [(r["step"], r["scale"], r["skipped"], r["sampled"]) for r in watch.records] == expected
    planted = {r["step"]: r for r in watch.records}[at]
    assert planted["first_nonfinite"] == {"path": "2", "direction": "backward", "tensor": "grad_param",
                                          "exact": True}
    model = body_and_head()
    amp = unimp.apply("mixed_fp16", model, two_sgds(model))
    amp.backward(loss_fn(model(data[0][0]), data[0][1]))
    amp.optimizers[1].step()
    with pytest.raises(UnsupportedError, match=r"1 of the 2 optimizers .*mid-iteration.*after amp.update\(\)"):
        amp.watch()  # its first record would miss the head's part of the iteration
    amp.update()
    assert amp.watch(every=1) is not None  # between iterations
    amp.remove()


@pytest.mark.parametrize("preset", ["mixed_fp16", "fp16_master", "pure_bf16"])
def test_body_and_head_optimizers_share_one_scale_and_update_like_fp32(preset):
    """Issue 32's model: ``unimp.apply(preset, model, [opt_body, opt_head])``: each optimizer's groups are
    the fp32 masters of its own parameters, and every update equals the fp32 reference's within the
    dtype's bound (never the scaled gradient's, never zero); mixed_fp16 equals autocast + GradScaler bit
    for bit."""
    data = mlp_batches(3)
    model = body_and_head()
    opts = two_sgds(model)
    amp = unimp.apply(preset, model, opts)
    assert [o.optimizer for o in amp.optimizers] == opts and amp.optimizer is amp.optimizers[0]
    if preset != "mixed_fp16":
        masters = {id(m): n for n, _, m in amp.master_weights}
        owned = [[masters[id(p)] for g in o.param_groups for p in g["params"]] for o in amp.optimizers]
        assert owned == [["0.weight", "0.bias", "2.weight", "2.bias"], ["4.weight", "4.bias"]]
        assert all(p.dtype == torch.float32 for o in amp.optimizers for g in o.param_groups for p in g["params"])
    before = params_of(model)
    train(model, amp, data)
    updates = [a - b for a, b in zip(params_of(model), before, strict=True)]
    errors = rel_errors(updates, fp32_updates(data))
    assert max(errors) < update_tolerance(preset), errors
    assert amp.state_dict()["steps"] == len(data)  # one loss-scale update per iteration, not per optimizer
    amp.remove()
    if preset == "mixed_fp16":  # native: autocast + one GradScaler stepping both optimizers, then one update
        native = body_and_head()
        opts = two_sgds(native)
        scaler = torch.amp.GradScaler("cpu")
        for x, y in data:
            for o in opts:
                o.zero_grad()
            with torch.autocast("cpu", torch.float16):
                logits = native(x)
            scaler.scale(loss_fn(logits, y)).backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
        assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(native), strict=True))


@pytest.mark.parametrize("built", ["before_apply", "after_apply"])
@pytest.mark.parametrize("preset", ["mixed_fp16", "fp16_master", "pure_bf16"])
def test_unwrapped_optimizer_refused_at_its_first_step(preset, built):
    """Issue 32: a second optimizer unimp does not wrap, stepped after amp.backward(loss): refused at its first
    step, naming the fix, the model's weights untouched (it would have applied the scaled gradient, or an
    update the masters never get); amp.add_optimizer(opt) then makes the same loop right."""
    data = mlp_batches(2)
    model = body_and_head()
    opt_body = torch.optim.SGD(model[:4].parameters(), lr=0.1)
    opt_head = torch.optim.SGD(model[4].parameters(), lr=0.3, momentum=0.9) if built == "before_apply" else None
    amp = unimp.apply(preset, model, opt_body)
    if opt_head is None:
        opt_head = torch.optim.SGD(model[4].parameters(), lr=0.3, momentum=0.9)
    before = params_of(model)
    x, y = data[0]
    amp.backward(loss_fn(model(x), y))
    amp.optimizer.step()
    with pytest.raises(UnsupportedError, match=r"SGD.step\(\): this optimizer steps '4.weight.*"
                                               r"pass it to unimp.apply.*amp.add_optimizer"):
        opt_head.step()
    assert torch.equal(params_of(model)[4], before[4])  # the head: no update at all
    with pytest.raises(UnsupportedError, match=r"passed to unimp.apply.*step the wrapper"):
        opt_body.step()  # the optimizer passed to apply, stepped around its wrapper
    head = amp.add_optimizer(opt_head)
    assert amp.optimizers[-1] is head and head.optimizer is opt_head
    train(model, amp, data)
    ref = body_and_head()
    ref_body, ref_head = two_sgds(ref)
    x, y = data[0]
    loss_fn(ref(x), y).backward()
    ref_body.step()
    for x, y in data:
        ref_body.zero_grad(), ref_head.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_body.step(), ref_head.step()
    errors = rel_errors([a - b for a, b in zip(params_of(model), before, strict=True)],
                        [a - b for a, b in zip(params_of(ref), before, strict=True)])
    assert max(errors) < update_tolerance(preset), errors
    amp.remove()


def test_gradscaler_stepping_an_applied_model_refused_plain_optimizer_kept_under_mixed_bf16():
    """A GradScaler user's scaler.step(opt) on a model under a scaling policy is refused (scaled twice); under
    mixed_bf16 (no scaling, no masters) a plain optimizer steps the model exactly as under native autocast."""
    data = mlp_batches(2)
    model = body_and_head()
    amp = unimp.apply("mixed_fp16", model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data[0]
    scaler.scale(loss_fn(model(x), y)).backward()
    before = params_of(model)
    with pytest.raises(UnsupportedError, match="amp.add_optimizer"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model), strict=True))
    amp.remove()

    ours, native = body_and_head(), body_and_head()
    amp = unimp.apply("mixed_bf16", ours)
    for model, under in ((ours, None), (native, torch.bfloat16)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            with torch.autocast("cpu", under or torch.bfloat16, enabled=under is not None):
                logits = model(x)
            loss_fn(logits, y).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_of(ours), params_of(native), strict=True))
    amp.remove()


def test_two_optimizers_resume_mid_run_bitwise():
    """fp16_master, two Adams, a scale that changes: saving after 3 of 6 iterations (model, both optimizers,
    amp) and resuming into a fresh model gives bit for bit the run that never stopped."""
    import io

    data = mlp_batches(6)
    policy = {"extends": "fp16_master", "loss_scale": {"initial": 2.0 ** 20, "growth_interval": 2}}

    def start() -> tuple[nn.Module, unimp.Amp]:
        model = body_and_head()
        return model, unimp.apply(policy, model, [torch.optim.Adam(model[:4].parameters(), lr=1e-2),
                                                  torch.optim.Adam(model[4].parameters(), lr=3e-2)])

    model, amp = start()
    train(model, amp, data)
    straight, straight_scale = params_of(model), amp.state_dict()
    amp.remove()

    model, amp = start()
    train(model, amp, data[:3])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizers": [o.state_dict() for o in amp.optimizers],
                "amp": amp.state_dict()}, buf)
    amp.remove()
    buf.seek(0)
    saved = torch.load(buf)
    model, amp = start()
    model.load_state_dict(saved["model"])
    for o, sd in zip(amp.optimizers, saved["optimizers"], strict=True):
        o.load_state_dict(sd)
    amp.load_state_dict(saved["amp"])
    train(model, amp, data[3:])
    assert amp.state_dict() == straight_scale and straight_scale["scale"] != 2.0 ** 20
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), straight, strict=True))
    amp.remove()


# ---------------------------------------------------------------- Lightning manual optimization
def lightning_gan(precision_or_plugin) -> list[torch.Tensor]:
    """A LightningModule GAN under manual optimization (``automatic_optimization = False``, two optimizers from
    ``configure_optimizers``, ``self.optimizers()``, ``self.manual_backward``), as Lightning's GAN example."""
    import lightning as L

    class GAN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.generator = nn.Sequential(nn.Linear(NZ, 32), nn.LeakyReLU(0.2), nn.Linear(32, 16), nn.Tanh())
            self.discriminator = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
            self.automatic_optimization = False

        def forward(self, z):
            return self.generator(z)

        def training_step(self, batch, i):
            real, z = batch
            opt_d, opt_g = self.optimizers()
            fake = self(z)
            out = self.discriminator(torch.cat([real, fake.detach()])).float()  # one forward: see critic_loss
            target = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
            self.manual_backward(nn.functional.binary_cross_entropy_with_logits(out, target))
            opt_d.step()
            opt_d.zero_grad()
            out = self.discriminator(fake).float()
            self.manual_backward(nn.functional.binary_cross_entropy_with_logits(out, torch.ones_like(out)))
            opt_g.step()
            opt_g.zero_grad()

        def configure_optimizers(self):
            return [torch.optim.Adam(self.discriminator.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.generator.parameters(), lr=2e-3, betas=(0.5, 0.999))]

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(16, 16, generator=g) * 2 - 1,
                                                                      torch.randn(16, NZ, generator=g)), batch_size=4)
    options = {"plugins": [precision_or_plugin]} if not isinstance(precision_or_plugin, str) else {
        "precision": precision_or_plugin}
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **options)
    module = GAN()
    trainer.fit(module, data)
    return params_of(module)


@pytest.mark.parametrize("preset", ["mixed_bf16", "mixed_fp16"])
def test_lightning_manual_optimization_two_optimizers_matches_lightning_amp(preset):
    """UnimpPrecision with two optimizers under manual optimization: each optimizer's opt.step() unscales and
    steps its own parameters, one loss scale; every parameter equals Lightning's own mixed precision bit for
    bit (bf16-mixed; 16-mixed with torch's GradScaler on CPU, no overflow in these steps)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from unimp_torch.integrations.lightning import UnimpPrecision

    plugin = UnimpPrecision(preset)
    ours = lightning_gan(plugin)
    assert [type(o.optimizer).__name__ for o in plugin.amp.optimizers] == ["Adam", "Adam"]
    assert plugin.amp.state_dict()["steps"] == 4  # one update per iteration (4 batches), not per optimizer
    native = lightning_gan("bf16-mixed" if preset == "mixed_bf16" else MixedPrecision("16-mixed", "cpu"))
    assert all(torch.equal(a, b) for a, b in zip(ours, native, strict=True))


# ---------------------------------------------------------------- several models in one process
def rows(report) -> dict[str, tuple[str, str]]:
    """``{path: (compute dtype, param dtype)}`` of the report's layers with parameters."""
    return {r.path: (r.compute_dtype, r.param_dtype) for r in report.rows if r.param_dtype is not None}


def test_distillation_teacher_frozen_inference_beside_trained_student():
    """A frozen teacher under an inference policy (mixed_bf16, no optimizer) beside a student trained under
    fp16_master: each report lists only its own model's layers in its own dtypes, the teacher's weights never
    change, and the student's update equals the fp32 reference's (same teacher outputs) within fp16's bound."""
    from collections import OrderedDict

    torch.manual_seed(5)
    teacher = nn.Sequential(OrderedDict(enc=nn.Linear(D_IN, 2 * HIDDEN), act=nn.ReLU(),
                                        cls=nn.Linear(2 * HIDDEN, CLASSES))).requires_grad_(False).eval()
    frozen = params_of(teacher)
    student = body_and_head(1)
    amp_t = unimp.apply("mixed_bf16", teacher)
    amp_s = unimp.apply("fp16_master", student, torch.optim.SGD(student.parameters(), lr=0.5))
    reference = body_and_head(1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    before = params_of(student)

    def kd(student_logits, teacher_logits, t=2.0):
        return nn.functional.kl_div(nn.functional.log_softmax(student_logits.float() / t, -1),
                                    nn.functional.softmax(teacher_logits.float() / t, -1), reduction="batchmean")

    for x, _ in mlp_batches(3):
        with torch.no_grad():
            t_logits = teacher(x)
        assert t_logits.dtype == torch.bfloat16
        amp_s.optimizer.zero_grad()
        amp_s.backward(kd(student(x), t_logits))
        amp_s.optimizer.step()
        ref_opt.zero_grad()
        kd(reference(x), t_logits).backward()
        ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_of(teacher), frozen, strict=True))
    assert rows(amp_t.report()) == {"enc": ("bfloat16", "float32"), "cls": ("bfloat16", "float32")}
    assert rows(amp_s.report()) == {p: ("float16", "float16") for p in ("0", "2", "4")}
    errors = rel_errors([a - b for a, b in zip(params_of(student), before, strict=True)],
                        [a - b for a, b in zip(params_of(reference), before, strict=True)])
    assert max(errors) < update_tolerance("fp16_master"), errors
    amp_s.remove(), amp_t.remove()


def test_reference_model_trl_style_gpt2_policy_beside_frozen_copy():
    """TRL's create_reference_model pattern on a tiny GPT-2 (HF, random init): the reference is a frozen
    ``copy.deepcopy`` of the policy model, each under its own policy; a DPO step trains the policy
    (its update equal to the fp32 reference's within fp16's bound), the reference never changes, and each
    report is its own. A copy made after apply already runs the policy's forward: applying again is refused,
    naming the fix."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(7)
    policy = GPT2LMHeadModel(config)
    fp32_policy = copy.deepcopy(policy)
    ref = copy.deepcopy(policy).requires_grad_(False).eval()  # trl.create_reference_model: a frozen deep copy
    frozen = params_of(ref)
    amp_ref = unimp.apply("mixed_bf16", ref)
    amp_pol = unimp.apply("fp16_master", policy, torch.optim.SGD(policy.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(8)
    chosen, rejected = (torch.randint(0, 64, (2, 12), generator=g) for _ in range(2))

    def logp(model, ids):
        logits = model(ids).logits[:, :-1].float()
        return torch.gather(logits.log_softmax(-1), 2, ids[:, 1:, None]).squeeze(-1).sum(-1)

    def dpo(model, ref_c, ref_r, beta=0.1):
        margin = (logp(model, chosen) - ref_c) - (logp(model, rejected) - ref_r)
        return -nn.functional.logsigmoid(beta * margin).mean()

    fp32_opt = torch.optim.SGD(fp32_policy.parameters(), lr=0.1)
    before = params_of(policy)
    for _ in range(2):
        with torch.no_grad():
            ref_c, ref_r = logp(ref, chosen), logp(ref, rejected)
        amp_pol.optimizer.zero_grad()
        amp_pol.backward(dpo(policy, ref_c, ref_r))
        amp_pol.optimizer.step()
        fp32_opt.zero_grad()
        dpo(fp32_policy, ref_c, ref_r).backward()
        fp32_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params_of(ref), frozen, strict=True))
    ours, theirs = rows(amp_pol.report()), rows(amp_ref.report())
    assert ours.keys() == theirs.keys() and ours  # the same layers (a copy), each report its own model's dtypes
    matmuls = {p for p, (c, _) in theirs.items() if c == "bfloat16"}  # Conv1D / lm_head: each its own dtype
    assert matmuls and all(ours[p][0] == "float16" for p in matmuls)
    assert {d for v in ours.values() for d in v} <= {"float16", "float32"}
    assert "float16" in {p for _, p in ours.values()}
    assert {d for v in theirs.values() for d in v} == {"bfloat16", "float32"}
    assert {p for _, p in theirs.values()} == {"float32"}
    moved = [(a - b, c - b) for a, b, c in zip(params_of(policy), before, params_of(fp32_policy), strict=True)
             if not torch.equal(c, b)]
    errors = rel_errors([u for u, _ in moved], [r for _, r in moved])
    assert max(errors) < (4 * config.n_embd + 2) * unit_roundoff("fp16_master"), errors  # K = the MLP's width
    with pytest.raises(RuntimeError, match="copy of a model with a unimp policy applied.*fresh model"):
        unimp.apply("mixed_bf16", copy.deepcopy(policy))
    amp_pol.remove(), amp_ref.remove()


def test_ema_averaged_model_averages_the_fp32_masters():
    """torch.optim.swa_utils.AveragedModel with get_ema_multi_avg_fn over a model under fp16_master, built and
    updated inside ``amp.masters_in_model()`` (the documented way): the EMA is of the fp32 masters, bit for
    bit what AveragedModel computes on an fp32 model holding the same weights (nested in the update's own
    block: see test_ema_plain_averaged_model_averages_the_fp32_masters).
    (timm's ModelEmaV3 is not installed in the torch env; AveragedModel is torch's own.)"""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = body_and_head()
    amp = unimp.apply("fp16_master", model, torch.optim.SGD(model.parameters(), lr=0.5))
    with amp.masters_in_model():
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    shadow = body_and_head()  # a plain fp32 model given the masters' values: torch's own EMA of them
    expected = AveragedModel(shadow, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for x, y in mlp_batches(4):
        amp.optimizer.zero_grad()
        amp.backward(loss_fn(model(x), y))
        amp.optimizer.step()
        with amp.masters_in_model():
            ema.update_parameters(model)
        with torch.no_grad():
            for s, (_, _, m) in zip(shadow.parameters(), amp.master_weights, strict=True):
                s.copy_(m)
        expected.update_parameters(shadow)
    assert all(p.dtype == torch.float32 for p in ema.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), expected.parameters(), strict=True))
    x = mlp_batches(1)[0][0]
    assert ema(x).dtype == model(x).dtype  # the copy runs under the policy too
    amp.remove()


def test_ema_plain_averaged_model_averages_the_fp32_masters():
    """The plain pattern (torch's docs, timm): ``ema = AveragedModel(model)`` after apply, then
    ``ema.update_parameters(model)`` each step, no ``masters_in_model()``: the EMA is bit for bit torch's
    EMA of an fp32 model holding the masters, and differs from the EMA of the float16 copies by more than
    float32 rounding (what it silently was before)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = body_and_head()
    amp = unimp.apply("fp16_master", model, torch.optim.SGD(model.parameters(), lr=0.5))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    shadow, rounded_shadow = body_and_head(), body_and_head()  # fp32 models given the masters / the fp16 copies
    expected = AveragedModel(shadow, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    rounded = AveragedModel(rounded_shadow, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    for x, y in mlp_batches(4):
        amp.optimizer.zero_grad()
        amp.backward(loss_fn(model(x), y))
        amp.optimizer.step()
        ema.update_parameters(model)
        with torch.no_grad():
            for s, r, (_, low, m) in zip(shadow.parameters(), rounded_shadow.parameters(), amp.master_weights,
                                         strict=True):
                s.copy_(m), r.copy_(low)
        expected.update_parameters(shadow)
        rounded.update_parameters(rounded_shadow)
    assert model[0].weight.dtype == torch.float16  # the model kept its low-precision copies
    assert all(p.dtype == torch.float32 for p in ema.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), expected.parameters(), strict=True))
    gap = max(float((a - b).abs().max() / b.abs().max()) for a, b in
              zip(rounded.parameters(), expected.parameters(), strict=True))
    assert gap > 8 * torch.finfo(torch.float32).eps, gap  # the two EMAs differ beyond float32 rounding
    x = mlp_batches(1)[0][0]
    assert ema(x).dtype == model(x).dtype  # the copy runs under the policy too
    amp.remove()


EMA_LR = 0.02  # small steps (a few 1e-3 of the weights over the run): where rounded weights would show


def ema_displacement(ema: nn.Module, start: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().double() - w.double() for p, w in zip(ema.parameters(), start, strict=True)]


@pytest.mark.parametrize("average", ["multi_avg_fn", "avg_fn"])
@pytest.mark.parametrize("preset", ["fp16_master", "pure_bf16"])
def test_ema_built_before_apply_averages_the_fp32_masters_like_fp32(preset, average):
    """The common order: ``ema = AveragedModel(model)`` first, then ``unimp.apply(preset, model, opt)``, then
    ``ema.update_parameters(model)`` each step. Against a plain fp32 run with the same AveragedModel: the EMA's
    move from the initial weights equals the fp32 EMA's within the dtype's update bound (as every update
    does), where an EMA of the low-precision copies is off by their rounding (checked beside it), and
    torch's foreach EMA (multi_avg_fn) mixing the fp32 copy with them raised a dtype error."""
    from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn

    def averaged(net: nn.Module) -> AveragedModel:
        return (AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if average == "multi_avg_fn"
                else AveragedModel(net, avg_fn=get_ema_avg_fn(0.9)))

    data = mlp_batches(4)
    reference = body_and_head()
    start = params_of(reference)
    ema_ref = averaged(reference)
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=EMA_LR), data, loss_fn,
                after=lambda: ema_ref.update_parameters(reference))

    model = body_and_head()
    ema = averaged(model)  # before apply
    amp = unimp.apply(preset, model, torch.optim.SGD(model.parameters(), lr=EMA_LR))
    rounded_shadow = body_and_head()  # an fp32 model given the low-precision copies: the EMA of what they hold
    rounded = averaged(rounded_shadow)

    @torch.no_grad()
    def update_both() -> None:
        ema.update_parameters(model)
        for r, (_, low, _) in zip(rounded_shadow.parameters(), amp.master_weights, strict=True):
            r.copy_(low)
        rounded.update_parameters(rounded_shadow)

    train_steps(model, amp.optimizer, data, loss_fn, amp, after=update_both)
    assert all(p.dtype == torch.float32 for p in ema.parameters())
    expected = ema_displacement(ema_ref, start)
    errors = rel_errors(ema_displacement(ema, start), expected)
    assert max(errors) < update_tolerance(preset), errors
    rounding = rel_errors(ema_displacement(rounded, start), expected)
    assert max(rounding) > update_tolerance(preset), rounding  # the same check fails the EMA of the copies
    amp.remove()


FRESH_PROCESS_EMA = """
import sys, torch, unimp
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # before unimp_torch is even imported
assert "unimp_torch" not in sys.modules
amp = unimp.apply("fp16_master", model, torch.optim.SGD(model.parameters(), lr=0.1))
shadow = AveragedModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)),
                       multi_avg_fn=get_ema_multi_avg_fn(0.9))  # torch's own EMA, given the masters
for _ in range(3):
    amp.optimizer.zero_grad()
    amp.backward(model(torch.randn(4, 8)).float().square().mean())
    amp.optimizer.step()
    ema.update_parameters(model)
    with amp.masters_in_model():
        shadow.update_parameters(model)
print(all(torch.equal(a, b) for a, b in zip(ema.parameters(), shadow.parameters(), strict=True)))
"""


def test_ema_built_before_the_torch_backend_is_imported_averages_the_fp32_masters():
    """``import unimp`` imports no framework backend: an AveragedModel built before the first ``unimp.apply``
    (in a fresh process, before ``unimp_torch`` is imported) is found at that apply, and its EMA is bit for bit
    torch's EMA of the masters (``update_parameters`` inside ``amp.masters_in_model()``, the documented way)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "backends" / "torch"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-B", "-W", "ignore", "-c", FRESH_PROCESS_EMA], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_several_optimizers_bad_input_names_the_optimizer_and_the_fix():
    """A parameter in two optimizers, an optimizer wrapped twice or over another model, an unknown optimizer
    to unscale, a scale shared across two rules: each refused before anything changes, naming the fix."""
    model = body_and_head()
    with pytest.raises(ValueError, match=r"optimizer\[1\]: .* also stepped by optimizer\[0\]"):
        unimp.apply("fp16_master", model, [torch.optim.SGD(model.parameters(), lr=0.1),
                                           torch.optim.SGD(model[4].parameters(), lr=0.1)])
    assert not unimp.Amp.is_bound(model) and model[0].weight.dtype == torch.float32
    body = torch.optim.SGD(model[:4].parameters(), lr=0.1)
    amp = unimp.apply("fp16_master", model, [body])
    with pytest.raises(ValueError, match="already wrapped"):
        amp.add_optimizer(body)
    with pytest.raises(ValueError, match=r"also stepped by amp.optimizers\[0\]"):
        amp.add_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1))  # the low copies of body's params
    with pytest.raises(ValueError, match="not a parameter of this model"):
        amp.add_optimizer(torch.optim.SGD(body_and_head().parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"not one of this Amp's optimizers.*amp.add_optimizer"):
        amp.unscale_(torch.optim.SGD(model[4].parameters(), lr=0.1))
    other = body_and_head()
    with pytest.raises(UnsupportedError, match="one shared scale runs one rule"):
        unimp.apply({"extends": "mixed_fp16", "loss_scale": {"initial": 1024.0}}, other,
                    torch.optim.SGD(other.parameters(), lr=0.1), share_scale_with=amp)
    assert not unimp.Amp.is_bound(other)
    amp.remove()
