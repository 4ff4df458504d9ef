"""CPU facts in the XLA:CPU decisions (expectations from unimp.hardware, never this machine).

XLA:CPU does not use bf16 units (measured), so `auto` is float32 on every CPU; the warning for an
explicit bf16 says whether this CPU emulates it. `tox -e hwsim` reruns these under a simulated
AVX2-only CPU (UNIMP_CPU_FEATURES=avx2, XLA_FLAGS=--xla_cpu_max_isa=AVX2).
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import unimp
from unimp import hardware

pytestmark = [pytest.mark.hardware,
              pytest.mark.skipif(jax.default_backend() != "cpu", reason="about XLA:CPU")]


def test_auto_is_float32_on_every_cpu_and_names_the_cpu():
    plan = unimp.get_backend("jax").compile(unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto"}))
    assert plan.compute_dtype == "float32" and hardware.cpu().describe() in plan.compute_reason
    units = "has bfloat16 units but XLA:CPU does not use them" if hardware.cpu().native_bf16 else "no native"
    assert units in plan.compute_reason


def test_explicit_bf16_runs_and_the_warning_says_whether_this_cpu_emulates_it():
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = unimp.apply("mixed_bf16", model, optax.sgd(0.1))
    (msg,) = [str(w.message) for w in caught if "XLA:CPU runs slower" in str(w.message)]
    assert ("XLA:CPU emulates it" in msg) is hardware.cpu().emulated("bfloat16")
    assert amp.plan.compute_dtype == "bfloat16"  # it runs as asked
    assert jnp.isfinite(amp.model(jnp.ones((2, 16)))).all()
    amp.remove()
