"""tf.distribute.MirroredStrategy on 2 logical CPU devices, under one policy.

The runs happen in a fresh process (``distributed_worker.py``: TensorFlow's logical devices must
be configured before it initialises them); this module only checks what it measured. Expected
loss-scale trajectories come from the core (``unimp.loss_scale.LossScale``), expected reduced
gradients from ``ml_dtypes`` roundings, never from the backend.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import unimp
from unimp.loss_scale import LossScale

WORKER = Path(__file__).with_name("distributed_worker.py")
# Measured max relative loss difference mirrored (2 x 8 rows) vs one device (16 rows): 1.0e-4 (pure_bf16 1.5e-4)
# (the per-replica sums + all-reduce reorder the float32/float16 gradient sums); allow 1e-3. Stated, not derived:
# both runs are in one process on one CPU (or the same simulated one), so only the sum order differs between them.
RTOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "runs.json"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([sys.executable, str(WORKER), str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def reference(policy, finites):
    """The core's scale after each step and its final state."""
    outs = list(LossScale(unimp.load(policy).loss_scale).replay(finites))
    return [o.scale for o in outs], outs[-1].state.to_dict()


def finites(n, bad=None):
    return [i != bad for i in range(n)]


def test_two_replicas(runs):
    assert runs["replicas"] == 2
    assert all(len(s) == 2 for s in runs["mirrored"]["scales"])
    assert runs["mirrored"]["wrapper"] == "AmpOptimizer"


@pytest.mark.parametrize("name", ["mirrored", "mirrored_poison"])
def test_replicas_identical_every_step(runs, name):
    r = runs[name]
    for step in range(len(r["losses"])):
        assert r["model"][step][0] == r["model"][step][1], f"model variables differ across replicas at {step}"
        assert r["opt"][step][0] == r["opt"][step][1], f"optimizer variables differ across replicas at {step}"
        assert r["scales"][step][0] == r["scales"][step][1]


def test_custom_loop_matches_single_device(runs):
    single, mirrored = runs["single"], runs["mirrored"]
    np.testing.assert_allclose(mirrored["losses"], single["losses"], rtol=RTOL)
    assert mirrored["losses"] != single["losses"]  # really two different runs (different sum order)
    scales, state = reference(runs["policy"], finites(len(single["losses"])))
    for r in (single, mirrored):
        assert [s[0] for s in r["scales"]] == scales
        assert r["state"] == state


def test_fit_matches_single_device(runs):
    # fit's loss (SparseCategoricalCrossentropy, mean over the global batch) is the custom loop's
    # loss: the one-device custom loop is the reference run
    single, mirrored = runs["single"], runs["fit_mirrored"]
    n = len(mirrored["losses"])
    np.testing.assert_allclose(mirrored["losses"], single["losses"][:n], rtol=RTOL)
    scales, state = reference(runs["policy"], finites(n))
    assert mirrored["scales"] == [scales[-1]] * 2
    assert mirrored["state"] == state
    assert mirrored["model"][0] == mirrored["model"][1]
    assert mirrored["jit_compile"] is False  # Keras' 'auto' under tf.distribute


def test_overflow_on_one_replica_skips_on_all(runs):
    r, bad = runs["mirrored_poison"], runs["poison_step"]
    scales, state = reference(runs["policy"], finites(len(r["losses"]), bad))
    assert [s[0] for s in r["scales"]] == [s[1] for s in r["scales"]] == scales
    assert r["state"] == state and state["skipped"] == 1
    assert [s[0] for s in r["skipped"]] == [int(i >= bad) for i in range(len(r["losses"]))]
    for part in ("model", "opt"):  # skipped step: bit-identical variables and optimizer state
        assert r[part][bad] == r[part][bad - 1], part
        assert r[part][bad + 1] != r[part][bad], part
    assert np.isfinite(r["losses"]).all()
    # the same skip on one device gives the same losses
    np.testing.assert_allclose(r["losses"], runs["single_poison"]["losses"], rtol=RTOL)


def test_pure_bf16_masters_under_mirrored(runs):
    single, mirrored, bad = runs["pure_single"], runs["pure_mirrored"], runs["poison_step"]
    scales, state = reference(runs["pure_policy"], finites(len(single["losses"]), bad))
    assert [s[0] for s in mirrored["scales"]] == [s[1] for s in mirrored["scales"]] == scales
    assert mirrored["state"] == state == single["state"]
    np.testing.assert_allclose(mirrored["losses"], single["losses"], rtol=RTOL)
    assert mirrored["masters"] and len(mirrored["masters"]) == 2 * len(single["masters"])
    for low, cast_master in mirrored["masters"]:  # every replica's bf16 param == cast(its master)
        assert low == cast_master
    assert mirrored["model"][bad] == mirrored["model"][bad - 1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reduce_dtype_honoured(runs, dtype):
    g = np.float32(1 + 2.0 ** -12)  # each replica's gradient; SGD(lr=1) from w = 0
    sent = g if dtype == "float32" else np.float32(g.astype(getattr(ml_dtypes, dtype) if dtype == "bfloat16"
                                                            else np.float16))
    expected = -float(np.float32(sent + sent))
    r = runs["reduce"][dtype]
    assert r["w"] == [expected, expected]
    assert f"(SUM) in {dtype}" in r["note"]
    if dtype != "float32":
        assert expected != -float(2 * g)  # the test tells the two reductions apart


def test_jit_compile_refused_clearly(runs):
    msg = runs["errors"]["jit"]
    assert msg.startswith("UnsupportedError:"), msg
    assert "jit_compile=False" in msg and "21366" in msg


def test_keras_rule_under_strategy(runs):
    e = runs["errors"]
    assert e["native_None"] == "AmpOptimizer"  # unimp's wrapper runs Keras' rule, agreed
    assert e["native_True"].startswith("UnsupportedError:") and "replica 0" in e["native_True"]
    assert e["mixed_scopes"].startswith("ValueError:") and "strategy.scope()" in e["mixed_scopes"]
