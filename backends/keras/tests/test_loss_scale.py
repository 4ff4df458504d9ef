"""Loss scaling: unimp's optimizer vs the core reference for every knob, and Keras' own
LossScaleOptimizer vs the keras_mixed_float16 preset, on every Keras backend (each backend's own step:
unimp_keras.steps). Expected values come from unimp.loss_scale."""

import dataclasses
import pathlib
import random
import sys

import keras
import numpy as np
import pytest
from keras import ops
from keras_steps import replay_scales as _replay_keras
from keras_steps import step_fn as _step_fn
from keras_steps import tiny_variable as _tiny

import unimp
from unimp.conformance.loss_scale import (
    Replay,
    check_loss_scale_replay,
    check_system_replay,
    reference,
    replay_size,
)
from unimp.loss_scale import LossScale, LossScaleAtMinimumError, LossScaleState, trajectory
from unimp_keras.optimizer import AmpOptimizer
from unimp_keras.scaler import DeviceLossScale, decode, device_spec, transition

BACKEND = keras.backend.backend()
# Keras' LossScaleOptimizer multiplies its float32 scale with the backend's kernels: TensorFlow's CPU kernels
# and XLA (JAX) flush a subnormal result to 0, torch keeps it (IEEE)
KERAS_SUBNORMAL = "keep" if BACKEND == "torch" else "flush"

KNOBS = [
    {},  # torch GradScaler defaults
    {"growth_factor": 1.1, "backoff_factor": 0.3, "initial": 3.0, "min": 0.5},  # non-exact float32 products
    {"growth_schedule": "interval_plus_one", "on_max": "clamp", "max": 40.0},  # Flax
    {"growth_schedule": "window", "hysteresis": 2, "hysteresis_refill": ["growth"], "at_min": "clamp"},
    {"hysteresis": 3, "hysteresis_refill": ["finite", "backoff"]},  # Megatron-like
    {"growth_requires_finite": False, "initial": 3.0e38, "max": float("inf"), "min": 0.0},  # Keras: reaches inf
    {"mode": "static", "initial": 128.0},
    {"mode": "none", "skip_nonfinite": False},
]


def _spec(knobs, interval=3):
    base = {"extends": "mixed_fp16", "loss_scale": {"growth_interval": interval, "initial": 16.0, **knobs}}
    return unimp.load(base).loss_scale


def _sequences(n=4, length=40, seed=0):
    rng = random.Random(seed)
    return [[rng.random() > p for _ in range(length)] for p in (0.1, 0.3, 0.6)[:n]] + [[False] * 6 + [True] * 9]


def _initial(spec, batch):
    st = LossScale(device_spec(spec)).initial_state()
    return DeviceLossScale(ops.full([batch], np.float32(st.scale), "float32"),
                           *(ops.full([batch], v, "int32") for v in (0, st.hysteresis_left, 0, 0)))


def _compiled(fn):
    """``fn`` as the Keras backend compiles a training step: a tf.function, jax.jit; torch runs eagerly."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.function(fn)
    if BACKEND == "jax":
        import jax

        return jax.jit(fn)
    return fn


def _runner(spec, seqs):
    """The rule's transition over a batch of sequences (keras.ops.scan in one compiled function)."""
    spec = device_spec(spec)  # the fallbacks the Plan names (transition refuses a knob declared unsupported)
    T = max(map(len, seqs))
    fs = np.array([list(s) + [True] * (T - len(s)) for s in seqs]).T

    def run(fs):
        B = fs.shape[1]
        no_error = ops.zeros([B], "bool")

        def body(carry, f):
            st, err = carry
            new, error = transition(spec, st, f)
            error = no_error if error is None else error
            new = DeviceLossScale(*(ops.where(err | error, a, b) for a, b in zip(st, new, strict=True)))  # frozen
            carry = (new, err | error)
            return carry, carry
        return ops.scan(body, (_initial(spec, B), no_error), fs)[1]

    compiled = _compiled(run)
    if BACKEND == "jax":
        # one sequence per run: XLA:CPU's vectorised float32 division is not correctly rounded (1 ulp off on
        # ~17% of values over a vector of 8+); the optimizer's scale is a scalar, which XLA divides exactly
        runs = [compiled(fs[:, b:b + 1]) for b in range(fs.shape[1])]
        out = DeviceLossScale(*(np.concatenate([ops.convert_to_numpy(r[0][i]) for r in runs], axis=1)
                                for i in range(5)))
        errors = np.concatenate([ops.convert_to_numpy(r[1]) for r in runs], axis=1)
    else:
        out, errors = compiled(fs)
    out = DeviceLossScale(*(ops.convert_to_numpy(x) for x in out))
    scales, skipped, errors = ops.convert_to_numpy(decode(out.scale)), out.skipped, ops.convert_to_numpy(errors)
    reps = []
    for b, seq in enumerate(seqs):
        n = len(seq)
        hit = np.flatnonzero(errors[:n, b])
        stop = int(hit[0]) if hit.size else n
        skips = np.diff(np.concatenate([[0], skipped[:stop, b]])) > 0
        final = LossScaleState(float(scales[n - 1, b]), *(int(x[n - 1, b]) for x in out[1:]))
        reps.append(Replay(list(scales[:stop, b]), list(skips), int(hit[0]) if hit.size else None,
                           None if hit.size else final))
    return reps


def test_state_machine_replays_the_reference_for_every_knob():
    """The conformance replay (subnormal scales included: computed in float64 on the float32 grid
    and stored from their bits, although TensorFlow's CPU kernels flush float32 subnormals; on JAX the
    knobs XLA cannot hold run as the Plan's fallbacks, device_spec)."""
    assert check_loss_scale_replay(_runner, effective=device_spec, n_sequences=8) == 8 * 24


def test_float64_scales_are_a_plan_fallback():
    policy = unimp.load({"extends": "mixed_fp16", "loss_scale": {"scale_dtype": "float64"}})
    with pytest.raises(unimp.UnsupportedError, match=r"scale_dtype = 'float64' cannot be honoured.*fix"):
        unimp.get_backend("keras").compile(policy)
    plan = unimp.get_backend("keras").compile(policy.replace(on_unsupported="fallback"))
    assert any("scale_dtype = 'float64' runs as 'float32'" in n for n in plan.notes)


@pytest.mark.parametrize("knobs", KNOBS[:-3] + KNOBS[-2:], ids=lambda k: ",".join(k) or "defaults")
def test_unimp_optimizer_matches_reference(knobs):
    """Real gradients through the real optimizer in each backend's step; skipped steps keep every bit."""
    spec = device_spec(_spec(knobs))  # on JAX: the knobs XLA runs (the Plan's fallbacks)
    opt = AmpOptimizer(keras.optimizers.Adam(0.01), spec)
    w = _tiny()
    step = _step_fn(opt, w)
    state = LossScale(spec).initial_state()
    for seq in _sequences():
        for i, finite in enumerate(seq):
            before = [v.numpy().copy() for v in (w, *opt.inner_optimizer.variables)]
            step(not finite)
            out = LossScale(spec).update(state, finite)
            state = out.state
            got = opt.loss_scale_state()
            assert got == state, f"step {i}: reference {state}, unimp {got}"
            if out.skipped:
                after = [v.numpy() for v in (w, *opt.inner_optimizer.variables)]
                assert all(np.array_equal(a, b) for a, b in zip(before, after)), "skipped step changed state"
    assert int(ops.convert_to_numpy(opt.iterations)) == state.steps - state.skipped


def test_at_min_error_raises_at_the_floor():
    spec = _spec({"at_min": "error", "initial": 2.0, "min": 1.0})
    if BACKEND == "jax":  # nothing raises inside a jitted step: the Plan declares it (fallback: clamp)
        with pytest.raises(unimp.UnsupportedError, match=r"at_min = 'error'.*fix: at_min = 'clamp'"):
            unimp.get_backend("keras").compile(unimp.load({"extends": "mixed_fp16", "loss_scale": {
                "at_min": "error", "initial": 2.0, "min": 1.0}}))
        return
    opt = AmpOptimizer(keras.optimizers.SGD(0.1), spec)
    w = _tiny()
    step = _step_fn(opt, w)
    step(True)  # 2 -> 1
    if BACKEND == "tensorflow":
        import tensorflow as tf

        error = tf.errors.InvalidArgumentError
    else:
        error = LossScaleAtMinimumError
    with pytest.raises(error, match="loss scale already at its minimum"):
        step(True)


def _keras3(spec, seq):
    """Keras 3's own LossScaleOptimizer, real gradients. Once its scale is 0 (flushed) every
    gradient unscales to inf/NaN, and once it is inf (Keras 3 grows without a finiteness check)
    every scaled gradient is inf: no step can be finite any more, so it is driven only up to there
    (the scale stays 0 or inf either way)."""
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=spec.initial,
                                              dynamic_growth_steps=spec.growth_interval)
    w = _tiny()
    step = _step_fn(opt, w)
    scales, skips = [], []
    for i, finite in enumerate(seq):
        if scales and scales[-1] in (0.0, float("inf")):
            return Replay(scales, skips, stop=i)
        before = int(opt.inner_optimizer.iterations.numpy()) if opt.built else 0
        step(not finite)
        skips.append(int(opt.inner_optimizer.iterations.numpy()) == before)
        scales.append(float(opt.dynamic_scale.numpy()))
    return Replay(scales, skips)


def test_keras3_replays_its_preset_and_the_tf_rule():
    """keras.optimizers.LossScaleOptimizer = keras_mixed_float16 (subnormal = "flush": TensorFlow's
    kernels and XLA flush its float32 scale; torch keeps it) = unimp_keras's rule, on the system replay
    sequences."""
    spec = dataclasses.replace(unimp.load("keras_mixed_float16").loss_scale, subnormal=KERAS_SUBNORMAL)
    n, longest = replay_size(0.5)
    assert check_system_replay(_keras3, spec, n=n, max_len=longest, backend=_runner,
                               effective=device_spec) == n


@pytest.mark.parametrize("preset", ["tf_keras_mixed_float16", "torch_autocast_cuda", "paddle_o1"])
def test_rule_replays_other_presets_on_the_system_sequences(preset):
    """The rule keeps subnormal scales (torch, Paddle: min 0) although TensorFlow's kernels flush them."""
    spec = unimp.load(preset).loss_scale
    check_system_replay(lambda s, seq: reference(s, seq), spec, backend=_runner, effective=device_spec)


def test_keras_rule_is_not_the_torch_rule():
    """Keras' fixed rule differs from the default (torch) knobs: unimp's optimizer is used there."""
    seq = [True] * 5 + [False] * 3 + [True] * 4
    torch_like = unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 3, "initial": 32768.0})
    native = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=3)
    assert _replay_keras(native, [True] * 200) != trajectory(torch_like.loss_scale, [True] * 200)[0]  # no cap
    ours = AmpOptimizer(keras.optimizers.SGD(0.1), torch_like.loss_scale)
    assert _replay_keras(ours, seq) == trajectory(torch_like.loss_scale, seq)[0]


@pytest.mark.keras_backend("tensorflow")
def test_real_tf_keras_replays_its_preset_and_the_tf_rule():
    """Where tf_keras is installed (not in the tox matrix; tests/test_loss_scale_systems.py checks the
    reference against its recorded digests): its _DynamicLossScaleState = tf_keras_mixed_float16."""
    pytest.importorskip("tf_keras")
    sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "tests" / "fixtures"))
    from make_loss_scale_systems import tf_keras

    n, longest = replay_size(0.5)
    assert check_system_replay(tf_keras, unimp.load("tf_keras_mixed_float16").loss_scale, n=n, max_len=longest,
                               backend=_runner, effective=device_spec) == n
