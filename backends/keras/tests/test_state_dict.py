"""Garbage state dicts through the Keras Amp on every Keras backend (unimp's and Keras' own loss-scale optimizer,
before and after the optimizer is built): one StateError, nothing applied (issue 14, item 13)."""

import keras
import numpy as np
import pytest

import unimp
from unimp.conformance.state_dicts import amp_checks, check_removed
from unimp_keras.steps import custom_step

X = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")
CASES = [("mixed_fp16", True), ("mixed_fp16", False), ("keras_mixed_float16", True), ("keras_mixed_float16", False),
         ("mixed_bf16", True)]


def _mse(out, y):
    return keras.ops.mean(keras.ops.square(keras.ops.cast(out, "float32") - y))


def _apply(policy, stepped):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    amp = unimp.apply(policy, model, keras.optimizers.SGD(0.1))
    if stepped:  # builds the optimizer: the state lives in its variables
        custom_step(amp, _mse, X, np.zeros_like(X))  # each Keras backend's own step
    return amp


@pytest.fixture(scope="module", params=CASES, ids=str)
def amp(request):
    a = _apply(*request.param)
    yield a
    a.remove()


(test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
 test_deepcopy_of_the_amp_works_or_is_refused_clearly) = amp_checks()


@pytest.mark.parametrize("case", CASES[:3], ids=str)
def test_a_removed_amp_refuses(case):
    check_removed(_apply(*case))


@pytest.mark.parametrize("scale", [1e-45, 1.2e-45, 3e-45, 1e-40 + 7e-46, 1e-39])
@pytest.mark.parametrize("stepped", [True, False], ids=["built", "unbuilt"])
def test_a_subnormal_scale_off_the_float32_grid_is_held_as_ieee_rounds_it(scale, stepped):
    """A loaded scale between float32's subnormals (policy subnormal = 'keep', as torch and IEEE) is
    held as numpy's float32 rounds it (to nearest), the value torch's float32 scale tensor holds;
    TensorFlow's cast flushes subnormals, and building them from bits without rounding first truncated
    1e-45 to 0 (a zero scale: every later step skipped)."""
    amp = _apply("fp16_master", stepped)
    state = dict(amp.state_dict(), scale=scale)
    amp.load_state_dict(state)
    assert amp.state_dict()["scale"] == float(np.float32(scale)) > 0
