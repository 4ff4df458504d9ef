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


def test_optimizer_stepped_twice_before_the_update_is_refused_naming_amp_update():
    model = body_and_head()
    amp = unimp.apply(POLICY, model, two_optimizers(model))
    x, y = batches(1)[0]
    amp.backward(loss_of(model, x, y, 0, ()))
    amp.optimizers[0].step()
    with pytest.raises(UnsupportedError, match=r"already stepped.*amp.update\(\)"):
        amp.optimizers[0].step()
    with pytest.raises(UnsupportedError, match="1 of the 2 optimizers"):
        amp.state_dict()
    amp.update()  # GradScaler.update(): the iteration ends with the body alone stepped
    assert amp.state_dict()["steps"] == 1
    amp.remove()
