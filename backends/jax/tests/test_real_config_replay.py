"""Flax's DynamicScale and jmp's DynamicLossScale configured from real files (tests/fixtures/
real_configs/flax and /jmp: the lines as Flax's examples and jmp's README write them, executed) against
the policy `unimp import` reads from the same lines: the same constructor values (and jmp's policy
dtypes), then the same scales on the system replay sequences (test_scaler's ``_flax`` / ``_jmp``
drivers and the core's reference)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax.training import dynamic_scale as dynamic_scale_lib
from test_scaler import _flax, _jmp

from unimp.conformance.loss_scale import check_system_replay
from unimp.migrate.corpus import entries, imported, pasted

ROOT = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "real_configs"
FLAX = [e for e in entries(ROOT, "flax") if "expect" in e and "DynamicScale" in pasted(ROOT, e)]  # a DynamicScale line


@pytest.mark.parametrize("entry", FLAX, ids=lambda e: f"{e['file']}:{e['lines'][0]}")
def test_flax_dynamic_scale_line_runs_the_imported_policy(entry):
    spec = imported(ROOT, entry).policy.loss_scale
    ns = {"dynamic_scale_lib": dynamic_scale_lib, "DynamicScale": dynamic_scale_lib.DynamicScale}
    exec(pasted(ROOT, entry), ns)
    (real,) = [v for v in ns.values() if isinstance(v, dynamic_scale_lib.DynamicScale)]
    assert (real.growth_factor, real.backoff_factor, real.growth_interval, real.fin_steps) == (
        spec.growth_factor, spec.backoff_factor, spec.growth_interval, 0)
    assert float(real.scale) == spec.initial and float(real.minimum_scale) == spec.min
    assert check_system_replay(_flax, spec, n=4, max_len=200) == 4


def test_jmp_readme_lines_run_the_imported_policy():
    jmp = pytest.importorskip("jmp")
    (entry,) = [e for e in entries(ROOT, "jmp") if e.get("lines") == [[95, 95], [175, 175]]]
    policy = imported(ROOT, entry).policy
    ns = {"jmp": jmp}
    exec(pasted(ROOT, entry), ns)
    real_policy, real_scale = ns["my_policy"], ns["loss_scale"]
    assert (np.dtype(real_policy.param_dtype).name, np.dtype(real_policy.compute_dtype).name,
            np.dtype(real_policy.output_dtype).name) == (policy.param_dtype, policy.compute_dtype,
                                                         policy.output_dtype)
    spec = policy.loss_scale
    assert float(real_scale.loss_scale) == spec.initial and int(real_scale.period) == spec.growth_interval
    assert float(real_scale.factor) == spec.growth_factor and float(real_scale.min_loss_scale) == spec.min
    assert float(jnp.float32(1.0) / real_scale.factor) == spec.backoff_factor
    assert check_system_replay(_jmp, spec, n=4, max_len=200) == 4
