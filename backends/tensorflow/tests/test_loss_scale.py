"""Loss scaling: unimp's optimizer vs the core reference for every knob, and Keras' own
LossScaleOptimizer vs the keras_mixed_float16 preset. Expected values come from unimp.loss_scale."""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

import unimp
from unimp.loss_scale import LossScale, trajectory
from unimp_tensorflow.optimizer import KerasLossScaleOptimizer, LossScaleOptimizer
from unimp_tensorflow.scaler import State, next_state

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


def _tiny():
    """A real variable + Adam slots; the step's gradient is finite or inf as asked."""
    w = keras.Variable(np.array([1.0, -2.0], np.float32), name="w")
    return w


def _step_fn(opt, w):
    @tf.function
    def step(poison):
        with tf.GradientTape() as tape:
            loss = 1e-30 * tf.reduce_sum(w * w) * tf.where(poison, tf.constant(np.inf, tf.float32), 1.0)
            scaled = opt.scale_loss(loss)
        opt.apply_gradients([(tape.gradient(scaled, w), w)])
    return step


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(k) or "defaults")
def test_state_machine_matches_reference(knobs):
    """The TF ops alone (inf scales included: no real gradient can stay finite at scale inf)."""
    spec = _spec(knobs)
    ref = LossScale(spec).initial_state()
    st = State(tf.constant(ref.scale, tf.float32), *(tf.constant(v, tf.int64) for v in (0, ref.hysteresis_left, 0, 0)))
    for seq in _sequences():
        for finite in seq:
            ref = LossScale(spec).update(ref, finite).state
            st = next_state(spec, st, tf.constant(finite))
            got = (float(st.scale), int(st.growth_tracker), int(st.hysteresis_left), int(st.skipped), int(st.steps))
            assert got == (ref.scale, ref.growth_tracker, ref.hysteresis_left, ref.skipped, ref.steps)


@pytest.mark.parametrize("knobs", KNOBS[:-3] + KNOBS[-2:], ids=lambda k: ",".join(k) or "defaults")
def test_unimp_optimizer_matches_reference(knobs):
    """Real gradients through the real optimizer under tf.function; skipped steps keep every bit."""
    spec = _spec(knobs)
    opt = LossScaleOptimizer(keras.optimizers.Adam(0.01), spec)
    w = _tiny()
    step = _step_fn(opt, w)
    state = LossScale(spec).initial_state()
    for seq in _sequences():
        for i, finite in enumerate(seq):
            before = [v.numpy().copy() for v in (w, *opt.inner_optimizer.variables)]
            step(tf.constant(not finite))
            out = LossScale(spec).update(state, finite)
            state = out.state
            got = opt.loss_scale_state()
            assert got == state, f"step {i}: reference {state}, unimp {got}"
            if out.skipped:
                after = [v.numpy() for v in (w, *opt.inner_optimizer.variables)]
                assert all(np.array_equal(a, b) for a, b in zip(before, after)), "skipped step changed state"
    assert int(opt.iterations.numpy()) == state.steps - state.skipped


def test_at_min_error_raises_at_the_floor():
    spec = _spec({"at_min": "error", "initial": 2.0, "min": 1.0})
    opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), spec)
    w = _tiny()
    step = _step_fn(opt, w)
    step(tf.constant(True))  # 2 -> 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="loss scale already at its minimum"):
        step(tf.constant(True))


def _replay_keras(opt, seq):
    w = _tiny()
    step = _step_fn(opt, w)
    scales = []
    for finite in seq:
        step(tf.constant(not finite))
        scales.append(float(opt.dynamic_scale.numpy()))
    return scales


@pytest.mark.parametrize("seed", [0, 1])
def test_keras_loss_scale_optimizer_is_the_keras_mixed_float16_preset(seed):
    """Random overflow sequences through the real keras.optimizers.LossScaleOptimizer."""
    preset = unimp.load("keras_mixed_float16").replace(loss_scale={"growth_interval": 3})
    for seq in _sequences(seed=seed):
        expected, _ = trajectory(preset.loss_scale, seq)
        native = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=3)
        assert _replay_keras(native, seq) == expected
        ours = KerasLossScaleOptimizer(keras.optimizers.SGD(0.1), preset.loss_scale)
        assert _replay_keras(ours, seq) == expected
        assert ours.loss_scale_state().skipped == sum(not f for f in seq)


def test_keras_rule_is_not_the_torch_rule():
    """Keras' fixed rule differs from the default (torch) knobs: unimp's optimizer is used there."""
    seq = [True] * 5 + [False] * 3 + [True] * 4
    torch_like = unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 3, "initial": 32768.0})
    native = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), dynamic_growth_steps=3)
    assert _replay_keras(native, [True] * 200) != trajectory(torch_like.loss_scale, [True] * 200)[0]  # no cap
    ours = LossScaleOptimizer(keras.optimizers.SGD(0.1), torch_like.loss_scale)
    assert _replay_keras(ours, seq) == trajectory(torch_like.loss_scale, seq)[0]
