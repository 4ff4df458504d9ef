"""Loss scaling at its bounds on every Keras backend (issue 27 item 8, issue 24): a state with every
counter at the int32 bound loads and steps through a real Keras training step as the reference
:class:`unimp.LossScale` does (Keras' own LossScaleOptimizer refuses a tracker it never grows from);
a knob the backend declared unsupported (``scale_dtype = "float64"``) is never run in float32 silently."""

import dataclasses

import keras
import numpy as np
import pytest
from keras import ops

import unimp
from unimp.conformance.state_dicts import check_counters_at_bound
from unimp.errors import StateError, UnsupportedError
from unimp.loss_scale import LossScale
from unimp.policy.spec import INT32_MAX
from unimp_keras.scaler import DeviceLossScale, next_state
from unimp_keras.steps import custom_step, optimizer_step

X = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")


def _apply(policy):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    return unimp.apply(policy, model, keras.optimizers.SGD(0.1))


def _mse(out, y):
    return ops.mean(ops.square(ops.cast(out, "float32") - y))


def _step(amp, finite=True):
    """One real training step, each Keras backend's own (unimp_keras.steps); the gradients inf unless finite."""
    custom_step(amp, _mse, X, np.zeros_like(X), poison=not finite)


@pytest.mark.parametrize("policy", ["mixed_fp16", "deepspeed_zero_fp16", "keras_mixed_float16"])
@pytest.mark.parametrize("finite", [True, False])
def test_counters_at_the_int32_bound_step_as_the_reference(policy, finite):
    amp = _apply(policy.replace("deepspeed_zero_fp16", "tf_keras_mixed_float16"))
    _step(amp)  # builds the optimizer: the state lives in its variables
    st = check_counters_at_bound(amp, _step, finite)  # the tracker at interval - 1: Keras' own optimizer too
    assert (st.steps, st.skipped) == (INT32_MAX, INT32_MAX)
    assert st.growth_tracker == 0 and (st.scale > 1024.0) == finite
    amp.remove()


def test_keras_native_at_the_bound_it_reaches_runs_like_keras():
    """Keras' LossScaleOptimizer grows when step_counter == dynamic_growth_steps - 1
    (keras/src/optimizers/loss_scale_optimizer.py, _stateful_handle_finite_grads): from the largest
    tracker it produces (interval - 1) both grow; steps and skipped saturate at the int32 bound."""
    policy = unimp.load("keras_mixed_float16").replace(loss_scale={"growth_interval": INT32_MAX})
    amp = _apply(policy)
    _step(amp)
    amp.load_state_dict({**amp.state_dict(), "growth_tracker": INT32_MAX - 1, "scale": 1024.0,
                         "steps": INT32_MAX, "skipped": INT32_MAX - 1})
    keras_lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0,
                                                    dynamic_growth_steps=INT32_MAX)
    v = keras.Variable(np.ones(2, np.float32))
    keras_lso.build([v])
    keras_lso.step_counter.assign(INT32_MAX - 1)
    optimizer_step(keras_lso, [v], lambda: ops.sum(v))(False)  # each backend's step (gradient: ones)
    _step(amp)
    assert amp.scale == float(keras_lso.dynamic_scale.numpy()) == 2048.0
    _step(amp, False)
    st = amp.loss_scale_state()
    assert (st.steps, st.skipped, st.scale) == (INT32_MAX, INT32_MAX, 1024.0)
    amp.remove()


def test_float64_is_refused_by_the_rule_not_run_in_float32():
    """deepspeed_fp16 holds its scale in float64 (55831.53912545033 where float32 gives 55831.5390625;
    growth at 8.5e37 clamps to 2**128 where float32 overflows): the TensorFlow rule refuses the spec,
    apply refuses the policy, and on_unsupported = "fallback" runs float32 with the Plan saying so."""
    spec = unimp.load("deepspeed_fp16").loss_scale
    st = DeviceLossScale(ops.convert_to_tensor(65536.0), *[ops.convert_to_tensor(v, "int32") for v in (0, 1, 0, 0)])
    with pytest.raises(UnsupportedError, match=r"scale_dtype = 'float64' cannot be honoured"):
        next_state(spec, st, ops.convert_to_tensor(True))
    with pytest.raises(UnsupportedError, match="scale_dtype"):
        _apply("deepspeed_fp16")
    amp = _apply(unimp.load("deepspeed_fp16").replace(on_unsupported="fallback"))
    assert any("scale_dtype = 'float64' runs as 'float32'" in n for n in amp.plan.notes)
    _step(amp)
    want = LossScale(dataclasses.replace(amp.plan.loss_scale, scale_dtype="float32")).update(
        LossScale(amp.plan.loss_scale).initial_state(), True).state
    assert amp.loss_scale_state() == want
    with pytest.raises(StateError, match="above the largest float32"):  # what it runs cannot hold 1e39
        amp.load_state_dict({**amp.state_dict(), "scale": 1e39})
    amp.remove()


def test_a_subnormal_initial_scale_is_held_and_follows_the_reference():
    """torch's GradScaler(init_scale=2**-140) runs; TensorFlow's conversions flush a float32
    subnormal (Keras' own LossScaleOptimizer(initial_scale=2**-140) reads back 0.0 and stays there):
    unimp's optimizer holds the scale from its bits, and its scales are the reference's on the skip
    decisions the real steps took."""
    policy = unimp.load("mixed_fp16").replace(loss_scale={"initial": 2.0 ** -140, "min": 0.0, "growth_interval": 1})
    if keras.backend.backend() == "jax":  # XLA:CPU flushes float32 subnormals: the Plan declares it
        with pytest.raises(UnsupportedError, match=r"loss_scale.initial = .* cannot be honoured.*fix: initial >= "):
            _apply(policy)
        return
    amp = _apply(policy)
    assert amp.scale == 2.0 ** -140
    flags, scales = [], []
    for f in (True, True, False, True):
        before = amp.skipped_steps
        _step(amp, f)
        flags.append(amp.skipped_steps == before)
        scales.append(amp.scale)
    assert scales == [o.scale for o in LossScale(policy.loss_scale).replay(flags)]
    assert amp.scale > 0
    amp.load_state_dict({**amp.state_dict(), "scale": 2.0 ** -149})
    assert amp.scale == 2.0 ** -149
    amp.remove()
