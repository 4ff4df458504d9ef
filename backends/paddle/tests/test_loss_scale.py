"""unimp's Paddle-tensor scaler vs the core reference; Paddle's own rules vs the paddle_o1/o2 presets."""

import random

import numpy as np
import paddle
import pytest

import unimp
from unimp.conformance.loss_scale import Replay, check_loss_scale_replay, check_system_replay
from unimp.loss_scale import LossScale, LossScaleAtMinimumError
from unimp.loss_scale.rule import f32
from unimp_paddle.scaler import DeviceLossScale


def _host_runner(spec, seqs):
    """DeviceLossScale (what amp.optimizer.step() uses), per sequence; its float32 scale tensor
    must hold the float32 rounding of the reference's scale at every step."""
    out = []
    for seq in seqs:
        ours, scales, skips, error_at = DeviceLossScale(spec), [], [], None
        for i, finite in enumerate(seq):
            try:
                skips.append(ours.update(finite))
            except LossScaleAtMinimumError:
                error_at = i
                break
            scales.append(ours.state().scale)
            assert ours.scale.dtype == paddle.float32
            assert float(ours.scale.numpy()[0]) == f32(scales[-1]), f"scale tensor at step {i}"
        out.append(Replay(scales, skips, error_at, None if error_at is not None else ours.state()))
    return out


def test_step_scaler_replays_the_reference_for_every_knob():
    assert check_loss_scale_replay(_host_runner, n_sequences=8) == 8 * 24


def test_backward_scales_and_step_unscales_the_real_grads(kit):
    """amp.backward multiplies by the current scale; step() divides the grads back exactly."""
    from unimp.conformance import probe_batches, probe_weights

    policy = unimp.load({"extends": "fp32", "loss_scale": {"mode": "dynamic", "initial": 1024.0,
                                                           "growth_interval": 1}})
    b = probe_batches(3)
    plain = kit.build_probe(probe_weights())
    model = kit.build_probe(probe_weights())
    amp = kit.apply(policy, model, kit.make_optimizer(model))
    ref = LossScale(policy.loss_scale)
    state = ref.initial_state()
    for batch in b:
        x = paddle.to_tensor(batch.tokens.astype("int64"))
        y = paddle.to_tensor(batch.targets.astype("int64")).unsqueeze(-1)
        plain.set_state_dict(model.state_dict())
        for p in plain.parameters():
            p.clear_gradient()
        (-paddle.take_along_axis(plain(x), y, axis=-1).mean()).backward()
        amp.backward(-paddle.take_along_axis(amp.model(x), y, axis=-1).mean())
        grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        for n, p in plain.named_parameters():
            np.testing.assert_array_equal(grads[n], p.grad.numpy() * np.float32(state.scale), err_msg=n)
        amp.optimizer.found_inf()  # unscale only (the test's view of step()'s first half)
        for n, p in plain.named_parameters():
            np.testing.assert_array_equal(dict(model.named_parameters())[n].grad.numpy(), p.grad.numpy())
        amp.optimizer.clear_grad()
        amp.backward(-paddle.take_along_axis(amp.model(x), y, axis=-1).mean())
        amp.optimizer.step()
        amp.optimizer.clear_grad()
        state = ref.update(state, True).state
        assert amp.scale == state.scale == float(amp.scaler.scale.numpy()[0])
    assert amp.scale == 1024.0 * 2 ** 3
    amp.remove()


def test_at_min_error_raises_like_the_reference():
    spec = unimp.load({"loss_scale": {"initial": 1.0, "min": 1.0, "at_min": "error"}}).loss_scale
    with pytest.raises(LossScaleAtMinimumError, match="at_min = 'clamp'"):
        DeviceLossScale(spec).update(False)


def _gradscaler(spec, decr_every_n):
    """A real paddle.amp.GradScaler driven through its own ``_update`` rule.

    On CPU GradScaler disables itself in __init__ ("AmpScaler can only be enabled on CUDAPlace");
    we set the fields its __init__ sets when enabled, then drive its ``_update`` with
    ``_cache_found_inf`` exactly as its ``step()``/``minimize()`` do after the inf check.
    """
    s = paddle.amp.GradScaler(init_loss_scaling=spec.initial, incr_ratio=spec.growth_factor,
                              decr_ratio=spec.backoff_factor, incr_every_n_steps=spec.growth_interval,
                              decr_every_n_nan_or_inf=decr_every_n)
    assert not s._enable  # the CPU fact this test works around
    s._enable, s._use_dynamic_loss_scaling = True, True
    s._init_loss_scaling, s._incr_ratio, s._decr_ratio = spec.initial, spec.growth_factor, spec.backoff_factor
    s._incr_every_n_steps, s._decr_every_n_nan_or_inf = spec.growth_interval, decr_every_n
    s._incr_count = s._decr_count = 0
    # 0-d, not [1] as __init__ makes it: _update's own log line calls float(self._scale), which
    # numpy>=2.3 refuses for a 1-element 1-d array (TypeError) -- a Paddle 3.3 + numpy 2 bug.
    s._scale = paddle.to_tensor(np.float32(spec.initial))
    return s


def _preset(name, interval, decr_every_n):
    return unimp.load(name).replace(loss_scale={"growth_interval": interval, "hysteresis": decr_every_n})


def _sequences(n, length, p_inf, seed=0):
    rng = random.Random(seed)
    return [[rng.random() >= p_inf for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("preset", ["paddle_static_o1"])
@pytest.mark.parametrize("decr_every_n", [1, 2, 3])
def test_update_loss_scaling_kernel_matches_preset(preset, decr_every_n):
    """Paddle's C++ rule (``_C_ops.update_loss_scaling_``, phi amp_kernel_impl.h; runs on CPU)."""
    spec = _preset(preset, 3, decr_every_n).loss_scale
    for seq in _sequences(20, 60, 0.35, seed=decr_every_n):
        x = [paddle.ones([2])]
        scale = paddle.to_tensor(np.array([spec.initial], np.float32))
        good, bad = paddle.zeros([1], "int32"), paddle.zeros([1], "int32")
        ref = LossScale(spec)
        state = ref.initial_state()
        for finite in seq:
            paddle._C_ops.update_loss_scaling_(x, paddle.to_tensor([not finite]), scale, good, bad,
                                               spec.growth_interval, decr_every_n, spec.growth_factor,
                                               spec.backoff_factor, False)
            state = ref.update(state, finite).state
            assert float(scale.numpy()[0]) == state.scale


@pytest.mark.parametrize("preset", ["paddle_o1", "paddle_o2"])
@pytest.mark.parametrize("decr_every_n", [1, 2, 3])
def test_dygraph_gradscaler_matches_preset(preset, decr_every_n):
    """The dygraph GradScaler._update (what ``paddle.amp.GradScaler.step`` runs on GPU) equals the
    paddle_o1/o2 presets: no floor, no inf guard."""
    spec = _preset(preset, 3, decr_every_n).loss_scale
    for seq in _sequences(20, 60, 0.35, seed=10 + decr_every_n):
        s, ref = _gradscaler(spec, decr_every_n), LossScale(spec)
        state = ref.initial_state()
        for finite in seq:
            s._cache_found_inf = not finite
            s._update()
            state = ref.update(state, finite).state
            assert float(s._scale.numpy()) == state.scale
            assert (s._incr_count, s._decr_count) == (state.growth_tracker, decr_every_n - state.hysteresis_left)


def test_dygraph_gradscaler_has_no_floor_unlike_the_static_kernel():
    """GradScaler._update backs off below 1 (paddle_o1); the static graph's kernel floors at 1."""
    spec = _preset("paddle_o1", 2000, 1).loss_scale
    static = LossScale(_preset("paddle_static_o1", 2000, 1).loss_scale)
    s, state, ref = _gradscaler(spec, 1), LossScale(spec).initial_state(), LossScale(spec)
    st_state = static.initial_state()
    for _ in range(20):
        s._cache_found_inf = True
        s._update()
        state = ref.update(state, False).state
        st_state = static.update(st_state, False).state
    assert st_state.scale == 1.0
    assert float(s._scale.numpy()) == state.scale == 65536.0 * 0.5 ** 20


def _paddle_gradscaler(spec, seq):
    s = _gradscaler(spec, spec.hysteresis)
    scales, skips = [], []
    for finite in seq:
        s._cache_found_inf = not finite
        s._update()
        scales.append(float(s._scale.numpy()))
        skips.append(not finite)  # GradScaler.step skips exactly when _found_inf
    return Replay(scales, skips)


def _static_kernel(spec, seq):
    x = [paddle.ones([2])]
    scale = paddle.to_tensor(np.array([spec.initial], np.float32))
    good, bad = paddle.zeros([1], "int32"), paddle.zeros([1], "int32")
    scales = []
    for finite in seq:
        paddle._C_ops.update_loss_scaling_(x, paddle.to_tensor([not finite]), scale, good, bad, spec.growth_interval,
                                           spec.hysteresis, spec.growth_factor, spec.backoff_factor, False)
        scales.append(float(scale.numpy()[0]))
    return Replay(scales, [not f for f in seq])


@pytest.mark.parametrize(("preset", "native"), [("paddle_o1", _paddle_gradscaler),
                                               ("paddle_static_o1", _static_kernel)])
def test_paddle_scalers_replay_their_presets_and_the_step_scaler(preset, native):
    """paddle.amp.GradScaler._update (no floor: scales reach the subnormal range and 0) and the static
    update_loss_scaling kernel = their presets = DeviceLossScale, on the system replay sequences."""
    assert check_system_replay(native, unimp.load(preset).loss_scale, backend=_host_runner) >= 16


def test_a_dynamic_scale_starts_where_paddle_gradscaler_starts():
    """``loss_scale.initial = "auto"`` (the default; float16 on this CPU is refused, so float32 compute with the
    dynamic rule) on Paddle: Paddle's own ``GradScaler`` default is the oracle (read from its signature: on a CPU
    a ``GradScaler()`` disables itself and reports a scale of 1)."""
    import inspect

    model = paddle.nn.Linear(8, 4)
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    amp = unimp.apply({"extends": "fp32", "loss_scale": {"mode": "dynamic"}}, model, opt)
    default = inspect.signature(paddle.amp.GradScaler).parameters["init_loss_scaling"].default
    assert amp.scale == amp.plan.loss_scale.initial == float(default)
    amp.remove()
