"""The optimizer wrapper under faults: sparse gradients, a skipped first step, an exception inside
``step()``, garbage optimizer state. Expected values come from torch itself: ``torch.amp.GradScaler``
or plain float32 training on the same batches (a power-of-two loss scale is exact in float32)."""

import copy

import pytest
import torch
from torch import nn

import unimp
from unimp.errors import StateError

# compute in float32 so the only difference to plain torch is unimp's loss scaling / skipping
SCALED = unimp.load("torch_autocast_cuda").replace(compute_dtype="float32", loss_scale={"growth_interval": 3})


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(i))


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def _plain_run(make_opt, batches) -> list[torch.Tensor]:
    """Plain float32 training, no unimp: the reference."""
    model = _mlp()
    opt = make_opt(model.parameters())
    for i in batches:
        model(_batch(i)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


# ---------------------------------------------------------------- 14.3 sparse gradients
class SparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor, poison: bool = False) -> torch.Tensor:
        e = self.emb(idx)
        if poison:  # a real non-finite gradient that reaches the embedding (sparse) grad only
            e.register_hook(lambda g: g * float("inf"))
        return self.head(e).sum(1)


def test_sparse_gradients_match_gradscaler():
    """Sparse grads are unscaled and checked like torch.amp.GradScaler does it: same params, same
    scale, same skips, including steps where only the sparse gradient is non-finite."""
    torch.manual_seed(0)
    ref, ours = SparseNet(), SparseNet()
    ours.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0, growth_interval=3)
    amp = unimp.apply(SCALED, ours, torch.optim.SGD(ours.parameters(), lr=0.1))
    for i in range(10):
        idx = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(i))
        poison = i in (2, 6)
        scaler.scale(ref(idx, poison).square().mean()).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        amp.backward(amp.model(idx, poison).square().mean())
        assert ours.emb.weight.grad.is_sparse
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        assert amp.scale == scaler.get_scale(), i
        _assert_same(_params(ours), _params(ref))
    assert amp.skipped_steps == 2
    amp.remove()


# ---------------------------------------------------------------- 14.4 skipped steps change nothing
OPTIMIZERS = {
    f"{name}_{impl}": (lambda ps, cls=cls, kw=kw, impl=impl: cls(ps, **kw, **{impl: True}) if impl != "plain"
                       else cls(ps, **kw, foreach=False))
    for name, cls, kw in (("sgd_momentum", torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
                          ("adam", torch.optim.Adam, {"lr": 1e-2}),
                          ("adamw", torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}))
    for impl in ("fused", "foreach", "plain")
}


def _opt_state(opt: torch.optim.Optimizer) -> dict:
    return copy.deepcopy(opt.state_dict()["state"])


def _assert_state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for k in a[i]:
            assert torch.equal(torch.as_tensor(a[i][k]), torch.as_tensor(b[i][k])), (i, k)


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_skipped_first_and_later_steps_change_nothing(opt_name):
    make = OPTIMIZERS[opt_name]
    model = _mlp()
    opt = make(model.parameters())
    amp = unimp.apply(SCALED, model, opt)
    before = _params(model)
    amp.backward(amp.model(_batch(0)).square().mean() * float("inf"))  # overflow on the very first step
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    assert amp.skipped_steps == 1
    assert opt.state_dict()["state"] == {}  # "no state yet" stays so
    _assert_same(_params(model), before)
    for i in (1, 2, 3):
        amp.backward(amp.model(_batch(i)).square().mean())
        amp.optimizer.step()
        amp.optimizer.zero_grad()
    state, params = _opt_state(opt), _params(model)
    amp.backward(amp.model(_batch(4)).square().mean() * float("nan"))  # a later skip
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    _assert_state_equal(_opt_state(opt), state)
    _assert_same(_params(model), params)
    amp.backward(amp.model(_batch(5)).square().mean())
    amp.optimizer.step()
    assert amp.skipped_steps == 2
    # the skipped steps never happened: plain float32 training on the clean batches
    _assert_same(_params(model), _plain_run(make, [1, 2, 3, 5]))
    amp.remove()


# ---------------------------------------------------------------- 14.5 exceptions inside step()
class _InterruptOnce:
    """A step pre-hook on the user's optimizer: a Ctrl-C at the start of its next step."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, *_):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


@pytest.mark.parametrize("opt_name", ["sgd_momentum_plain", "adam_fused"])
@pytest.mark.parametrize("retry", [False, True], ids=["next_batch", "retry_step"])
def test_interrupted_step_leaves_no_stale_state(opt_name, retry):
    """An exception inside amp.optimizer.step() (caught, as in a notebook): the next step unscales
    its own gradients (not x65536), and retrying the step does not unscale twice."""
    make = OPTIMIZERS[opt_name]
    model = _mlp()
    opt = make(model.parameters())
    interrupt = _InterruptOnce()
    opt.register_step_pre_hook(interrupt)
    amp = unimp.apply(SCALED, model, opt)
    done = []
    for i in range(4):
        amp.backward(amp.model(_batch(i)).square().mean())
        interrupt.armed = i == 1
        try:
            amp.optimizer.step()
            done.append(i)
        except KeyboardInterrupt:
            assert i == 1 and amp.state_dict()["steps"] == 1  # the scaler did not count it
            if retry:
                amp.optimizer.step()
                done.append(i)
        amp.optimizer.zero_grad()
    assert amp.state_dict()["steps"] == len(done) and amp.skipped_steps == 0
    _assert_same(_params(model), _plain_run(make, done))
    amp.remove()


def test_unscale_then_clip_then_step_unscales_once():
    """amp.clip_grad_norm_ (unscale, clip in place) then step: the clipped grads are used as they are."""
    model, ref = _mlp(), _mlp()
    amp = unimp.apply(SCALED, model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        amp.backward(amp.model(_batch(i)).square().mean())
        amp.clip_grad_norm_(0.01)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        ref(_batch(i)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_same(_params(model), _params(ref))
    amp.remove()


# ---------------------------------------------------------------- 14.13 garbage optimizer state
def _corrupt(sd: dict, how: str) -> object:
    sd = copy.deepcopy(sd)
    last = max(sd["state"])
    if how == "not_a_dict":
        return [1, 2]
    if how == "no_state":
        del sd["state"]
    elif how == "no_groups":
        del sd["param_groups"]
    elif how == "extra_group":
        sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))
    elif how == "missing_param":
        sd["param_groups"][0]["params"].pop()
    elif how == "unknown_state_key":
        sd["state"][99] = sd["state"][last]
    elif how == "wrong_shape":
        sd["state"][last]["exp_avg"] = torch.zeros(3, 3)
    elif how == "nan_moment":
        sd["state"][last]["exp_avg_sq"] = torch.full_like(sd["state"][last]["exp_avg_sq"], float("nan"))
    elif how == "negative_step":
        sd["state"][last]["step"] = torch.tensor(-3.0)
    elif how == "fractional_step":
        sd["state"][last]["step"] = torch.tensor(2.5)
    elif how == "string_moment":
        sd["state"][last]["exp_avg"] = "zeros"
    elif how == "lr_string":
        sd["param_groups"][0]["lr"] = "fast"
    elif how == "lr_nan":
        sd["param_groups"][0]["lr"] = float("nan")
    elif how == "betas_short":
        sd["param_groups"][0]["betas"] = (0.9,)
    elif how == "amsgrad_number":
        sd["param_groups"][0]["amsgrad"] = 3
    return sd


GARBAGE = ["not_a_dict", "no_state", "no_groups", "extra_group", "missing_param", "unknown_state_key",
           "wrong_shape", "nan_moment", "negative_step", "fractional_step", "string_moment", "lr_string",
           "lr_nan", "betas_short", "amsgrad_number"]


@pytest.mark.parametrize("how", GARBAGE)
def test_garbage_optimizer_state_is_refused_whole(how):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = unimp.apply("pure_bf16", model, opt)
    for i in range(2):
        amp.backward(amp.model(_batch(i)).float().square().mean())
        amp.optimizer.step()
        amp.optimizer.zero_grad()
    good = copy.deepcopy(opt.state_dict())
    with pytest.raises(StateError, match=r"amp\.optimizer\.load_state_dict") as err:
        amp.optimizer.load_state_dict(_corrupt(good, how))
    if how in ("wrong_shape", "nan_moment", "negative_step", "string_moment"):
        assert "3.weight" in str(err.value) or "3.bias" in str(err.value)  # names the parameter
    after = opt.state_dict()
    _assert_state_equal(after["state"], good["state"])  # nothing applied
    assert after["param_groups"] == good["param_groups"]
    amp.optimizer.load_state_dict(good)  # the real one still loads
    amp.remove()


def test_loss_scale_state_that_does_not_fit_the_device_is_refused_whole():
    """A counter beyond the device's int32: StateError naming the key, the old state kept."""
    model = _mlp()
    amp = unimp.apply(SCALED, model, torch.optim.SGD(model.parameters(), lr=0.1))
    good = amp.state_dict()
    with pytest.raises(StateError, match="growth_tracker"):
        amp.load_state_dict(dict(good, scale=8.0, growth_tracker=2**40))
    assert amp.state_dict() == good
    amp.remove()


@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "adamw_fused"])
@pytest.mark.parametrize("preset", ["fp16_master", "pure_bf16", "mixed_fp16"])
def test_interrupt_in_a_step_post_hook_keeps_weights_and_counters(preset, opt_name):
    """Ctrl-C from a user's optimizer step post-hook (torch.optim.Optimizer.profile_hook_step runs
    instance post-hooks after the inner step): the inner step is done, so the model's weights equal
    the masters cast, the step is counted, and the next forward runs on the new weights. The hook
    also sees the updated model (unimp's own post-hook runs first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
            "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)}[opt_name]
    opt = make(model.parameters())
    amp = unimp.apply(preset, model, opt)
    seen = []

    def hook(optimizer, args, kwargs):
        seen.append([p.detach().clone() for p in model.parameters()])
        raise KeyboardInterrupt

    handle = opt.register_step_post_hook(hook)
    x = _batch(0)
    amp.backward(amp.model(x).float().square().mean())
    before = [p.detach().clone() for p in model.parameters()]
    steps = amp.state_dict()["steps"]
    with pytest.raises(KeyboardInterrupt):
        amp.optimizer.step()
    handle.remove()
    masters = {id(low): m for _, low, m in amp.master_weights}
    for p, old in zip(model.parameters(), before, strict=True):
        assert not torch.equal(p, old)  # the step happened
        if id(p) in masters:
            assert torch.equal(p, masters[id(p)].to(p.dtype))  # and the model holds it
    for p, s in zip(model.parameters(), seen[0], strict=True):
        assert torch.equal(p, s)  # the user's hook saw the stepped model
    assert amp.state_dict()["steps"] == steps + 1
    assert amp.optimizer.found_inf is None  # this step's grads are spent
    # the next step works on fresh grads, counted once
    amp.optimizer.zero_grad()
    amp.backward(amp.model(x).float().square().mean())
    amp.optimizer.step()
    assert amp.state_dict()["steps"] == steps + 2
    amp.remove()


@pytest.mark.parametrize("where", ["AfterInnerStep.__call__", "ParamState.sync_low", "DeviceLossScale.update"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("preset", ["fp16_master", "mixed_fp16"])
def test_interrupt_inside_unimps_own_finish_keeps_weights_and_counters(preset, opt_name, where):
    """Ctrl-C arriving inside unimp's own post-hook (the inner step done, the masters not yet copied to
    the model or the step not yet counted): the finish is completed before the interrupt propagates,
    so the model holds the masters cast and the step is counted once. The interrupt is raised by a
    trace function at that call, where a real Ctrl-C's handler would run."""
    import sys

    from unimp_torch.optimizer import AfterInnerStep
    from unimp_torch.params import ParamState
    from unimp_torch.scaler import DeviceLossScale

    code = {"AfterInnerStep.__call__": AfterInnerStep.__call__, "ParamState.sync_low": ParamState.sync_low,
            "DeviceLossScale.update": DeviceLossScale.update}[where].__code__
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    amp = unimp.apply({"extends": preset, "loss_scale": {"initial": 1024.0}}, model, opt)  # a finite first step
    amp.backward(amp.model(_batch(0)).float().square().mean())
    before, steps = _params(model), amp.state_dict()["steps"]

    def interrupt(frame, event, arg):
        if event == "call" and frame.f_code is code:
            raise KeyboardInterrupt

    sys.settrace(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            amp.optimizer.step()
    finally:
        sys.settrace(None)
    assert not all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))  # stepped
    for _, low, master in amp.master_weights:
        assert torch.equal(low, master.to(low.dtype))
    assert amp.state_dict()["steps"] == steps + 1
    amp.optimizer.zero_grad()
    amp.backward(amp.model(_batch(1)).float().square().mean())
    amp.optimizer.step()
    assert amp.state_dict()["steps"] == steps + 2
    amp.remove()


# ---------------------------------------------------------------- GradScaler idioms carried over (issue 27 item 14)
@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
@pytest.mark.parametrize("foreach", [None, False])
def test_gradscaler_clip_idiom_on_model_parameters_clips_the_masters(overflow, foreach):
    """``amp.unscale_()`` then ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` under
    fp16_master: the returned norm and the stepped weights are those of torch.amp.GradScaler's idiom
    (``scaler.unscale_(opt)``, ``clip_grad_norm_(params, c)``, ``scaler.step(opt)``; the
    'Gradient clipping' recipe of torch's AMP examples) on an fp32 model holding the same scaled
    gradients: the masters are what the optimizer steps, so they are what is clipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    ref = copy.deepcopy(model)  # the fp32 masters' twin
    amp = unimp.apply("fp16_master", model, torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=amp.scale, growth_interval=2000)
    scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor on the first scale() (torch/amp/grad_scaler.py)
    for i in range(3):
        loss = amp.model(_batch(i)).float().square().mean() * (1e30 if overflow and i == 1 else 1.0)
        amp.backward(loss)
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            r.grad = p.grad.float()  # the same scaled gradients, in the reference's fp32
        amp.unscale_()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=foreach)
        scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=foreach)
        # the norm is the fp32 norm of the same unscaled grads: equal up to the summation order of
        # torch's foreach kernel against its per-tensor one (a few float32 ulps)
        torch.testing.assert_close(norm, ref_norm, rtol=4 * torch.finfo(torch.float32).eps, atol=0, equal_nan=True)
        amp.optimizer.step()
        scaler.step(ref_opt)
        scaler.update()
        amp.optimizer.zero_grad()
        ref_opt.zero_grad()
        assert amp.skipped_steps == int(overflow and i >= 1)
        for (_, low, master), r in zip(amp.master_weights, ref.parameters(), strict=True):
            torch.testing.assert_close(master, r.detach(), rtol=4 * torch.finfo(torch.float32).eps, atol=1e-7)
            assert torch.equal(low, master.to(low.dtype))
    assert amp.scale == scaler.get_scale()
    amp.remove()


@pytest.mark.parametrize("verb", ["step", "unscale_", "clip_grad_norm_"])
@pytest.mark.parametrize("preset", ["fp16_master", "mixed_fp16"])
def test_plain_backward_before_a_scaled_step_is_refused(preset, verb):
    """``loss.backward()`` (no amp.backward) then ``amp.optimizer.step()``: the gradients are not
    scaled, so unscaling would divide them by the loss scale (65,536) and step on them silently (as
    a Trainer given amp.optimizer without unimp's integration did). Refused with the right call;
    nothing is stepped or counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    amp = unimp.apply(preset, model, torch.optim.SGD(model.parameters(), lr=0.1))
    # one correct step first: the check is per step, not only before the first
    amp.backward(amp.model(_batch(0)).float().square().mean())
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    before, state = _params(model), amp.state_dict()
    amp.model(_batch(1)).float().square().mean().backward()
    do = {"step": lambda: amp.optimizer.step(), "unscale_": lambda: amp.unscale_(),
          "clip_grad_norm_": lambda: amp.clip_grad_norm_(1.0)}[verb]
    with pytest.raises(unimp.errors.UnsupportedError, match=r"no loss was scaled since the last step.*"
                       r"plain loss\.backward\(\).*Call amp\.backward\(loss\)"):
        do()
    _assert_same(_params(model), before)
    assert amp.state_dict() == state
    # the right call works on the same batch
    amp.optimizer.zero_grad()
    amp.backward(amp.model(_batch(1)).float().square().mean())
    amp.optimizer.step()
    assert amp.state_dict()["steps"] == state["steps"] + 1
    amp.remove()


@pytest.mark.parametrize("verb", ["backward", "scale_loss"])
@pytest.mark.parametrize("preset", ["fp16_master", "mixed_fp16"])
def test_a_scaled_loss_after_unscale_before_the_step_is_refused(preset, verb):
    """Gradient accumulation with ``amp.unscale_()`` after a micro-batch that is not the last: the next
    micro-batch's scaled gradients would be added to the unscaled ones and the step would be wrong
    without a word (torch.amp.GradScaler lets ``scaler.step`` take such mixed gradients too: its
    per-optimizer stage is already UNSCALED, torch/amp/grad_scaler.py ``step``). Refused before the
    backward runs, with the right order; zero_grad() drops the unscaled set and starts a new one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    amp = unimp.apply(preset, model, torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(amp.model(_batch(0)).float().square().mean())
    amp.unscale_()
    grads, state = [p.grad.float().clone() for p in model.parameters()], amp.state_dict()
    loss = amp.model(_batch(1)).float().square().mean()
    do = {"backward": lambda: amp.backward(loss), "scale_loss": lambda: amp.scale_loss(loss).backward()}[verb]
    with pytest.raises(unimp.errors.UnsupportedError, match=r"already unscaled this step's gradients.*after the "
                       r"last micro-batch's amp\.backward\(loss\)"):
        do()
    _assert_same([p.grad.float() for p in model.parameters()], grads)
    assert amp.state_dict() == state
    amp.optimizer.zero_grad()  # drops the unscaled set: a new accumulation starts
    amp.backward(amp.model(_batch(1)).float().square().mean())
    amp.backward(amp.model(_batch(2)).float().square().mean())
    amp.unscale_()
    amp.optimizer.step()
    assert amp.state_dict()["steps"] == state["steps"] + 1
    amp.remove()


def test_plain_backward_without_loss_scaling_steps():
    """Without loss scaling (pure_bf16: scale 1) a plain backward is the same as amp.backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    amp = unimp.apply("pure_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = _params(model)
    amp.model(_batch(0)).float().square().mean().backward()
    amp.optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))
    amp.remove()
