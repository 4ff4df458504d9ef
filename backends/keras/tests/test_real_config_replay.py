"""Keras 3 configured from real files (tests/fixtures/real_configs/keras: the lines of Keras' own
docstrings, executed) against the policy `unimp import` reads from the same lines: a Dense layer's
compute and variable dtypes, the LossScaleOptimizer ``compile`` wraps (its constructor values), then
its scales on the system replay sequences (test_loss_scale's ``_keras3`` driver and the core's
reference). tf_keras' Model Garden files are not replayed: tf_keras is not in this env."""

from __future__ import annotations

from pathlib import Path

import keras
import pytest
from test_loss_scale import _keras3

from unimp.conformance.loss_scale import check_system_replay
from unimp.migrate.corpus import entries, imported, pasted

ROOT = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "real_configs"
KERAS = [e for e in entries(ROOT, "keras") if "expect" in e]


@pytest.fixture
def global_policy():
    before = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(before)


@pytest.mark.parametrize("entry", KERAS, ids=lambda e: f"{e['file']}:{e['lines'][0]}")
def test_keras_line_runs_the_imported_policy(entry, global_policy):
    policy = imported(ROOT, entry).policy
    ns = {"keras": keras, "dtype_policies": keras.dtype_policies}
    exec(pasted(ROOT, entry), ns)
    bound = [v for v in ns.values() if isinstance(v, keras.dtype_policies.DTypePolicy)]
    layer = keras.layers.Dense(4, dtype=bound[0] if bound else None)
    model = keras.Sequential([keras.Input((3,)), layer])
    assert (layer.dtype_policy.compute_dtype, layer.dtype_policy.variable_dtype) == (
        policy.compute_dtype, policy.param_dtype)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")  # Trainer.compile decides the wrapping
    wrapped = isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    spec = policy.loss_scale
    assert wrapped == (spec.mode == "dynamic")
    if wrapped:
        assert (float(model.optimizer.initial_scale), model.optimizer.dynamic_growth_steps) == (
            spec.initial, spec.growth_interval)
        assert check_system_replay(_keras3, spec, n=4, max_len=200) == 4
