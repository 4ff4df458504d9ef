"""Several optimizers on one Paddle model, one loss scale, side by side with ``paddle.amp.GradScaler``.

Paddle's recipe for two optimizers: ``scaler.scale(loss).backward(); scaler.step(opt1);
scaler.step(opt2); scaler.update()``. Paddle's dygraph AMP (and GradScaler) only run on CUDA; on
this CPU wheel the GradScaler is given the fields its ``__init__`` sets on a GPU (as
test_loss_scale.py does) and every kernel runs float32 on both sides (the policy's declared
fallback), so the comparison is of the loss-scaling bookkeeping, bit for bit.

One difference is by design: Paddle's ``GradScaler.update()`` reads only the *last* stepped
optimizer's flag (``_cache_found_inf``), torch's (and unimp's) any optimizer's; the tests compare
where they agree and pin unimp's rule where they do not.
"""

from collections import defaultdict

import numpy as np
import paddle
import pytest

import unimp
from unimp.errors import UnsupportedError

POLICY = {"extends": "paddle_o1", "on_unsupported": "fallback"}  # float32 kernels on CPU, the scale as o1's
INF = float("inf")


def body_and_head():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.ReLU(), paddle.nn.Linear(32, 4))


def two_optimizers(model):
    return [paddle.optimizer.SGD(0.1, parameters=model[0].parameters()),
            paddle.optimizer.Momentum(0.3, momentum=0.9, parameters=model[2].parameters())]


def batches(n):
    paddle.seed(1)
    return [(paddle.randn([8, 16]), paddle.randint(0, 4, [8])) for _ in range(n)]


def gradscaler(initial=65536.0):
    """A real paddle.amp.GradScaler with the fields its __init__ sets where it is enabled (a GPU)."""
    from paddle.amp.grad_scaler import _refresh_optimizer_state

    s = paddle.amp.GradScaler(init_loss_scaling=initial, decr_every_n_nan_or_inf=1)
    assert not s._enable  # the CPU fact this works around
    s._enable, s._use_dynamic_loss_scaling = True, True
    s._init_loss_scaling, s._incr_ratio, s._decr_ratio = initial, 2.0, 0.5
    s._incr_every_n_steps, s._decr_every_n_nan_or_inf = 2000, 1
    s._incr_count = s._decr_count = 0
    s._scale = paddle.to_tensor(np.float32(initial))
    for k in ("_found_inf", "_temp_found_inf_value_false", "_temp_found_inf_fp16", "_temp_found_inf_bf16",
              "_temp_found_inf_fp32"):
        setattr(s, k, paddle.to_tensor(np.array([0]).astype(np.bool_)))
    s._cache_found_inf, s._optimizer_states = None, defaultdict(_refresh_optimizer_state)
    return s


def loss_of(model, x, y, i, poison):
    return paddle.nn.functional.cross_entropy(model(x), y) * (INF if i in poison else 1.0)


def run(native, poison=(), head_inf=()):
    """Train; ``poison``: steps whose loss is inf (every gradient), ``head_inf``: steps where only the head's
    weight gradient is (the last optimizer's). Returns the parameters and the scale after each step."""
    model = body_and_head()
    opts = two_optimizers(model)
    scaler = gradscaler() if native else None
    amp = None if native else unimp.apply(POLICY, model, opts)
    scales = []
    for i, (x, y) in enumerate(batches(5)):
        hook = model[2].weight.register_hook(lambda g: g * INF) if i in head_inf else None
        if native:
            with paddle.amp.auto_cast(dtype="float16"):  # GradScaler.scale scales only inside float16 auto_cast
                scaled = scaler.scale(loss_of(model, x, y, i, poison))
            scaled.backward()
            for o in opts:
                scaler.step(o)
            scaler.update()
            scales.append(float(scaler._scale))
        else:
            amp.backward(loss_of(model, x, y, i, poison))
            for o in amp.optimizers:
                o.step()
            scales.append(amp.scale)
        if hook is not None:
            hook.remove()
        for o in opts:
            o.clear_grad()
    return [p.numpy() for p in model.parameters()], scales, amp


@pytest.mark.parametrize("case", ["finite", "all_inf", "last_optimizer_inf"])
def test_two_optimizers_one_gradscaler_bitwise(case):
    """unimp.apply(policy, model, [opt_body, opt_head]) against one GradScaler stepping both then updating once:
    the same parameters and scale bit for bit, a skip per optimizer on its own gradients."""
    kw = {"finite": {}, "all_inf": {"poison": (1,)}, "last_optimizer_inf": {"head_inf": (2,)}}[case]
    native, native_scales, _ = run(True, **kw)
    ours, our_scales, amp = run(False, **kw)
    assert our_scales == native_scales and (case == "finite") == (native_scales[-1] == 65536.0)
    assert all(np.array_equal(a, b) for a, b in zip(ours, native, strict=True))
    assert amp.state_dict()["steps"] == 5  # one update per iteration
    amp.remove()


def test_first_optimizer_inf_backs_off_once_and_skips_only_that_optimizer():
    """Only the first optimizer's gradients overflow: it skips, the other steps, and the one update backs off
    (GradScaler's torch rule; Paddle's GradScaler.update would read only the last optimizer's flag)."""
    model = body_and_head()
    amp = unimp.apply(POLICY, model, two_optimizers(model))
    x, y = batches(1)[0]
    before = [p.numpy() for p in model.parameters()]
    hook = model[0].weight.register_hook(lambda g: g * INF)
    amp.backward(loss_of(model, x, y, 0, ()))
    assert [o.step() for o in amp.optimizers] == [True, False]  # skipped: the body; the head stepped
    hook.remove()
    after = [p.numpy() for p in model.parameters()]
    assert [np.array_equal(a, b) for a, b in zip(before, after, strict=True)] == [True, True, False, False]
    assert (amp.scale, amp.skipped_steps, amp.state_dict()["steps"]) == (32768.0, 1, 1)
    amp.remove()
    other = body_and_head()
    with pytest.raises(ValueError, match=r"optimizer\[0\] and optimizer\[1\]"):
        unimp.apply(POLICY, other, [paddle.optimizer.SGD(0.1, parameters=other.parameters()) for _ in range(2)])


def half_stepped(policy, k):
    """An Amp over [body, head] mid-iteration: one backward, then only ``amp.optimizers[k]`` stepped."""
    model = body_and_head()
    amp = unimp.apply(policy, model, two_optimizers(model))
    x, y = batches(1)[0]
    amp.backward(loss_of(model, x, y, 0, ()))
    amp.optimizers[k].step()
    return amp


def test_optimizer_stepped_twice_before_the_update_is_refused_naming_amp_update():
    amp = half_stepped(POLICY, 0)
    with pytest.raises(UnsupportedError, match=r"already stepped.*amp.update\(\)"):
        amp.optimizers[0].step()
    with pytest.raises(UnsupportedError, match="1 of the 2 optimizers"):
        amp.state_dict()
    amp.update()  # GradScaler.update(): the iteration ends with the body alone stepped
    assert amp.state_dict()["steps"] == 1
    amp.remove()


def params_and_velocity(model, momentum):
    return [p.numpy() for p in model.parameters()], {k: v.numpy() for k, v in momentum.state_dict().items()
                                                     if hasattr(v, "numpy")}


@pytest.mark.parametrize("built", ["before_apply", "after_apply"])
@pytest.mark.parametrize("verb", ["step", "minimize", "apply_gradients"])
def test_unwrapped_optimizer_refused_at_its_first_step(built, verb):
    """Issue 32, fine-tuning a body and a head with an optimizer each: the head's optimizer, not passed to unimp,
    stepped after amp.backward(loss) (it would apply the scaled gradient) is refused at its first step by
    step(), minimize() or apply_gradients(), naming the fix, before its parameters or accumulators change; so is
    the body's optimizer stepped around its wrapper. amp.add_optimizer(head) then trains bit for bit as one
    paddle.amp.GradScaler stepping both optimizers."""
    model = body_and_head()
    opt_body, opt_head = two_optimizers(model) if built == "before_apply" else (two_optimizers(model)[0], None)
    amp = unimp.apply(POLICY, model, opt_body)
    if opt_head is None:
        opt_head = paddle.optimizer.Momentum(0.3, momentum=0.9, parameters=model[2].parameters())
    x, y = batches(1)[0]
    loss = loss_of(model, x, y, 0, ())
    amp.backward(loss)
    before = params_and_velocity(model, opt_head)
    stepping = {"step": lambda: opt_head.step(), "minimize": lambda: opt_head.minimize(loss),
                "apply_gradients": lambda: opt_head.apply_gradients(
                    [(p, p.grad) for p in model[2].parameters()])}[verb]
    with pytest.raises(UnsupportedError, match=r"Momentum.step\(\): this optimizer steps '2.weight' of a Sequential "
                                               r"under the unimp policy.*loss scale 65536 times too large.*"
                                               r"unimp.apply\(policy, model, \[optimizer, ...\]\).*amp.add_optimizer"):
        stepping()
    after = params_and_velocity(model, opt_head)
    assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0], strict=True)) and before[1] == after[1] == {}
    with pytest.raises(UnsupportedError, match=r"passed to unimp.apply.*step the wrapper"):
        opt_body.step()
    assert all(np.array_equal(a, b) for a, b in zip(before[0], [p.numpy() for p in model.parameters()], strict=True))
    opt_body.clear_grad(), opt_head.clear_grad()
    head = amp.add_optimizer(opt_head)
    assert amp.optimizers[-1] is head and head.inner is opt_head
    for i, (x, y) in enumerate(batches(5)):
        amp.backward(loss_of(model, x, y, i, ()))
        for o in amp.optimizers:
            o.step()
            o.clear_grad()
    native, native_scales, _ = run(True)
    assert all(np.array_equal(a, b) for a, b in zip([p.numpy() for p in model.parameters()], native, strict=True))
    assert (amp.scale, amp.state_dict()["steps"]) == (native_scales[-1], 5)
    amp.remove()
    opt_head.step()  # a plain model again: plain optimizers step it


def test_gradscaler_on_an_applied_layer_refused_plain_optimizer_kept_under_mixed_bf16():
    """A paddle.amp.GradScaler user's scaler.step(opt) on a layer whose loss unimp scales is refused (scaled
    twice); under mixed_bf16 (no scaling, no masters) a plain optimizer trains the layer exactly as under
    native paddle.amp.auto_cast, and adding a second optimizer to the Amp is refused on a shared parameter."""
    model = body_and_head()
    amp = unimp.apply(POLICY, model)
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    scaler = gradscaler()
    x, y = batches(1)[0]
    with paddle.amp.auto_cast(dtype="float16"):
        scaled = scaler.scale(loss_of(model, x, y, 0, ()))
    scaled.backward()
    before = [p.numpy() for p in model.parameters()]
    with pytest.raises(UnsupportedError, match=r"SGD.step\(\).*amp.add_optimizer"):
        scaler.step(opt)
    assert all(np.array_equal(a, b) for a, b in zip(before, [p.numpy() for p in model.parameters()], strict=True))
    amp.add_optimizer(paddle.optimizer.SGD(0.1, parameters=model[0].parameters()))
    with pytest.raises(ValueError, match=r"amp.add_optimizer: parameter .* is in optimizer\[0\] and optimizer\[1\]"):
        amp.add_optimizer(paddle.optimizer.SGD(0.1, parameters=model.parameters()))
    amp.remove()

    ours, native = body_and_head(), body_and_head()
    amp = unimp.apply({"extends": "mixed_bf16", "on_unsupported": "fallback"}, ours)
    for model, cast in ((ours, False), (native, True)):
        opt = paddle.optimizer.Momentum(0.1, momentum=0.9, parameters=model.parameters())
        for i, (x, y) in enumerate(batches(3)):
            with paddle.amp.auto_cast(enable=cast, dtype="bfloat16"):
                loss = loss_of(amp.model if model is ours else model, x, y, i, ())
            loss.backward()
            opt.step()
            opt.clear_grad()
    assert all(np.array_equal(a.numpy(), b.numpy())
               for a, b in zip(ours.parameters(), native.parameters(), strict=True))
    amp.remove()


def test_two_optimizers_resume_mid_run_bitwise():
    """Body and head with an Adam each, a scale that grows: saving after 3 of 6 iterations (layer, both
    optimizers, amp) and resuming into a fresh layer gives bit for bit the run that never stopped."""
    policy = {**POLICY, "loss_scale": {"initial": 2.0 ** 20, "growth_interval": 2}}
    data = batches(6)

    def start():
        model = body_and_head()
        return model, unimp.apply(policy, model, [paddle.optimizer.Adam(1e-2, parameters=model[0].parameters()),
                                                  paddle.optimizer.Adam(3e-2, parameters=model[2].parameters())])

    def train(model, amp, part):
        for x, y in part:
            amp.backward(paddle.nn.functional.cross_entropy(amp.model(x), y))
            for o in amp.optimizers:
                o.step()
                o.clear_grad()

    with paddle.utils.unique_name.guard():  # each run: the same parameter and accumulator names (state keys)
        model, amp = start()
        train(model, amp, data)
    straight, straight_state = [p.numpy() for p in model.parameters()], amp.state_dict()
    amp.remove()
    with paddle.utils.unique_name.guard():
        model, amp = start()
        train(model, amp, data[:3])
    saved = {"model": {k: v.numpy() for k, v in model.state_dict().items()},
             "optimizers": [{k: v.numpy() if hasattr(v, "numpy") else v for k, v in o.state_dict().items()}
                            for o in amp.optimizers], "amp": amp.state_dict()}
    amp.remove()
    with paddle.utils.unique_name.guard():
        model, amp = start()
        model.set_state_dict({k: paddle.to_tensor(v) for k, v in saved["model"].items()})
        for o, s in zip(amp.optimizers, saved["optimizers"], strict=True):
            o.set_state_dict({k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in s.items()})
        amp.load_state_dict(saved["amp"])
        train(model, amp, data[3:])
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(straight, model.parameters(), strict=True))
    assert amp.state_dict() == straight_state and straight_state["scale"] == 2.0 ** 23
    amp.remove()


def test_guard_on_optimizers_undone_by_the_last_remove():
    """The dygraph optimizers' update funnel is wrapped only while some Amp is applied: the last remove() (or
    the first step after the last Amp was dropped with its model) puts Paddle's own function back, exactly."""
    import gc

    own = paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"]
    a, b = body_and_head(), body_and_head()
    amp_a, amp_b = unimp.apply(POLICY, a), unimp.apply(POLICY, b)
    assert paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"] is not own
    amp_a.remove()
    assert paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"] is not own  # b is still applied
    amp_b.remove()
    assert paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"] is own
    unimp.apply(POLICY, body_and_head())  # dropped with its model, without remove()
    gc.collect()
    opt = paddle.optimizer.SGD(0.1, parameters=a.parameters())
    loss_of(a, *batches(1)[0], 0, ()).backward()
    opt.step()
    assert paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"] is own


@pytest.mark.skipif(not paddle.device.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0,
                    reason="no CUDA Paddle here (paddlepaddle CPU wheel): O2 decorate (masters) runs only on CUDA")
def test_cuda_unwrapped_optimizer_refused_under_master_weights():
    """pure_bf16 (O2, fp32 masters in the wrapped optimizer, no scaling): the head's plain optimizer would step
    the bf16 copies that the masters overwrite: refused; amp.add_optimizer(head) gives it masters, as
    paddle.amp.decorate(optimizers=...) does."""
    paddle.device.set_device("gpu")
    model = body_and_head()
    opt_body, opt_head = two_optimizers(model)
    amp = unimp.apply("pure_bf16", model, opt_body)
    x, y = batches(1)[0]
    amp.backward(paddle.nn.functional.cross_entropy(amp.model(x), y))
    with pytest.raises(UnsupportedError, match=r"its update would be lost.*amp.add_optimizer"):
        opt_head.step()
    assert amp.add_optimizer(opt_head).inner._multi_precision
    amp.remove()
    paddle.device.set_device("cpu")


# ---------------------------------------------------------------- amp.watch(): one record per iteration
WATCHED = {"extends": "mixed_fp16", "on_unsupported": "fallback", "loss_scale": {"initial": 8192.0,
                                                                                 "growth_interval": 1}}


def expected_records(scales, every):
    """What a watch must record, from a native GradScaler's scale after each iteration: ``(step, scale the
    iteration's loss was scaled by, skipped, sampled)`` for each iteration sampled (every ``every``-th from the
    first) or skipped (the scale backed off)."""
    before = [WATCHED["loss_scale"]["initial"], *scales[:-1]]
    return [(i, used, after < used, i % every == 0) for i, (used, after) in enumerate(zip(before, scales, strict=True))
            if i % every == 0 or after < used]


def watched_run(native, order, steps_body, planted, at, n=8, every=3, localize=False, added=False):
    """Train ``n`` iterations, stepping the optimizers in ``order`` (indices into [body, head]; the body only on
    iterations where ``steps_body(i)``), then ``scaler.update()`` / ``amp.update()``; at iteration ``at`` the
    gradient of layer ``planted``'s weight is infinite. ``added``: the Amp is applied with the first stepped
    optimizer, the other joins by ``amp.add_optimizer`` (else both in ``order``'s order: ``amp.optimizer``
    steps first). Returns the scale after each iteration, the parameters and the watch."""
    model = body_and_head()
    opts = two_optimizers(model)
    scaler = gradscaler(WATCHED["loss_scale"]["initial"]) if native else None
    if native:
        scaler._incr_every_n_steps = WATCHED["loss_scale"]["growth_interval"]
    amp, wrapped = None, {}
    if not native:
        amp = unimp.apply(WATCHED, model, opts[order[0]] if added else [opts[k] for k in order])
        if added:
            amp.add_optimizer(opts[order[1]])
        wrapped = {id(o.inner): o for o in amp.optimizers}
    watch = None if native else amp.watch(every=every, localize=localize)
    scales = []
    for i, (x, y) in enumerate(batches(n)):
        layer = model[int(planted)]
        hook = layer.weight.register_hook(lambda g: g * INF) if i == at else None
        stepping = [k for k in order if k == 1 or steps_body(i)]
        if native:
            with paddle.amp.auto_cast(dtype="float16"):
                scaled = scaler.scale(loss_of(model, x, y, i, ()))
            scaled.backward()
            for k in stepping:
                scaler.step(opts[k])
            scaler.update()
            scales.append(float(scaler._scale))
        else:
            amp.backward(loss_of(model, x, y, i, ()))
            for k in stepping:
                wrapped[id(opts[k])].step()
            amp.update()  # ends the iteration where the body did not step (a no-op after both stepped)
            scales.append(amp.scale)
        if hook is not None:
            hook.remove()
        for o in opts:
            o.clear_grad()
    params = [p.numpy() for p in model.parameters()]
    if amp is not None:
        amp.remove()
    return scales, params, watch


@pytest.mark.parametrize("first", ["body", "head"])
def test_watch_two_optimizers_one_record_per_iteration_whichever_steps_first(first):
    """amp.watch(every=3) on mixed_fp16 with two optimizers, both stepping every iteration, ``first`` first
    (body first: unimp.apply(policy, model, [body, head]); head first: applied with the head, the body joined by
    amp.add_optimizer), the planted overflow in the last one's weight gradient at an unsampled iteration.
    One record per iteration sampled or skipped, none lost or doubled, with the step, scale and skip of a
    paddle.amp.GradScaler run side by side (same parameters bit for bit); the planted layer located."""
    order = [0, 1] if first == "body" else [1, 0]
    planted, at = ("2", 4) if first == "body" else ("0", 4)  # the last stepped (GradScaler.update reads its flag)
    native, native_params, _ = watched_run(True, order, lambda i: True, planted, at)
    ours, params, watch = watched_run(False, order, lambda i: True, planted, at, added=first == "head")
    assert ours == native and all(np.array_equal(a, b) for a, b in zip(params, native_params, strict=True))
    expected = expected_records(native, every=3)
    assert (at, native[at - 1], True, False) in expected  # the planted iteration: skipped natively, not sampled
    assert [(r["step"], r["scale"], r["skipped"], r["sampled"]) for r in watch.records] == expected
    # no hook ran on the unsampled iteration: located from the gradients it left (not exact)
    assert {r["step"]: r for r in watch.records}[at]["first_nonfinite"] == {
        "path": planted, "direction": "backward", "tensor": "grad_param", "exact": False}


def test_watch_body_every_second_iteration_head_every_one_amp_update_and_mid_iteration_refused():
    """The head steps every iteration, the body (first) every second one, amp.update() ends each iteration
    (GradScaler's ``step(body); step(head); update()``): one record per iteration with GradScaler's step, scale
    and skip, the planted overflow (the head's weight gradient, an iteration the body skips) located; a watch
    started after one optimizer stepped is refused naming amp.update(), and starts after it."""
    at = 5
    native, native_params, _ = watched_run(True, [0, 1], lambda i: i % 2 == 0, "2", at, localize=True)
    ours, params, watch = watched_run(False, [0, 1], lambda i: i % 2 == 0, "2", at, localize=True)
    assert ours == native and all(np.array_equal(a, b) for a, b in zip(params, native_params, strict=True))
    expected = expected_records(native, every=3)
    assert (at, native[at - 1], True, False) in expected
    assert [(r["step"], r["scale"], r["skipped"], r["sampled"]) for r in watch.records] == expected
    assert {r["step"]: r for r in watch.records}[at]["first_nonfinite"] == {
        "path": "2", "direction": "backward", "tensor": "grad_param", "exact": True}  # localize: every step's hooks
    amp = half_stepped(WATCHED, 1)
    with pytest.raises(UnsupportedError, match=r"1 of the 2 optimizers .*mid-iteration.*after amp.update\(\)"):
        amp.watch()  # its first record would miss the head's part of the iteration
    assert not any(amp.iteration.listeners) and amp._watching is None  # nothing installed
    amp.update()
    assert amp.watch(every=1) is not None  # between iterations
    amp.remove()
