"""CPU facts decide `auto` and the emulation warning (expectations from unimp.hardware, never this machine).

`tox -e hwsim` reruns these under a simulated AVX2-only CPU (UNIMP_CPU_FEATURES=avx2 + ONEDNN_MAX_CPU_ISA /
XLA_FLAGS / ATEN_CPU_CAPABILITY), on each Keras backend.
"""

import warnings

import keras
import numpy as np
import pytest

import unimp
from unimp import hardware
from unimp.conformance.checks import check_emulation_warning
from unimp_keras.plan import gpu_capability

pytestmark = pytest.mark.hardware
CPU_ONLY = gpu_capability() is None  # the Keras backend's own GPU detection


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(8)])


@pytest.mark.skipif(not CPU_ONLY, reason="a GPU decides auto here")
def test_auto_on_cpu_is_bf16_only_with_native_units_and_says_which_cpu():
    amp = unimp.apply({"extends": "mixed_bf16", "compute_dtype": "auto"}, model(), keras.optimizers.SGD(0.1))
    facts = hardware.cpu()
    assert amp.plan.compute_dtype == ("bfloat16" if facts.native_bf16 else "float32")
    assert facts.describe() in amp.plan.compute_reason
    assert amp.model.layers[0].compute_dtype == amp.plan.compute_dtype
    amp.remove()


@pytest.mark.skipif(not CPU_ONLY, reason="the warning is about CPUs")
def test_explicit_bf16_runs_and_warns_at_the_callers_line_only_where_it_is_emulated():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = unimp.apply("mixed_bf16", model(), keras.optimizers.SGD(0.1))
    check_emulation_warning(caught, amp, __file__)
    assert amp.model.layers[0].compute_dtype == "bfloat16"  # it runs as asked
    x, y = np.random.default_rng(0).random((8, 16), np.float32), np.zeros((8, 8), np.float32)
    amp.model.compile(optimizer=amp.optimizer, loss="mse")
    assert np.isfinite(amp.model.train_on_batch(x, y))
    amp.remove()
