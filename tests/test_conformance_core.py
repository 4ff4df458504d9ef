"""The backend-independent parts of unimp.conformance: expectations, probe, casting."""

import numpy as np

import unimp
from unimp.conformance import (
    CHECKS,
    CUSTOM_MOVED_OPS,
    PROBE,
    STANDARD_POLICIES,
    cases,
    cast_like,
    expected_layers,
    probe_batches,
    probe_weights,
    reference_forward,
    reference_loss,
    standard_policy,
)
from unimp.conformance.select import CHECK_POLICIES, CHECK_TAGS
from unimp.plan import compile_ops


def dtypes(policy, **kw):
    return {k: v.compute_dtype for k, v in expected_layers(unimp.load(policy), **kw).items()}


def test_expected_dtypes_mixed_bf16():
    assert dtypes("mixed_bf16") == {"embed": "float32", "fc1": "bfloat16", "act": "bfloat16", "conv": "bfloat16",
                                    "norm": "float32", "head": "bfloat16", "logp": "float32"}


def test_expected_dtypes_custom_moved_ops():
    assert dtypes(CUSTOM_MOVED_OPS) == {"embed": "bfloat16", "fc1": "float32", "act": "float32",
                                        "conv": "bfloat16", "norm": "float32", "head": "bfloat16",
                                        "logp": "bfloat16"}


def test_expected_params_pure_bf16_keeps_norm_fp32():
    exp = expected_layers(unimp.load("pure_bf16"))
    assert exp["fc1"].param_dtype == "bfloat16" and exp["norm"].param_dtype == "float32"
    assert exp["act"].param_dtype is None


def test_promote_takes_the_widest_input():
    p = unimp.load({"extends": "mixed_bf16", "ops": {"promote": ["linear"]}})
    assert dtypes(p)["fc1"] == "float32"  # bf16? no: input fp32 (embedding) with fp32 params


def test_auto_is_resolved_by_the_plan():
    p = unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto"})
    plan = compile_ops("x", p, control={op: "op" for op in unimp.CANONICAL_OPS}, native={},
                       compute_dtype="float32", compute_reason="XLA:CPU bf16 is slower")
    assert set(dtypes(p, plan=plan).values()) == {"float32"}


def test_fallback_ops_follow_the_plan():
    p = unimp.load("mixed_bf16").replace(on_unsupported="fallback")
    plan = compile_ops("x", p, control={}, native={},
                       fixed={op: ("float32", "CPU has no bf16 kernels") for op in unimp.CANONICAL_OPS})
    assert set(dtypes(p, plan=plan).values()) == {"float32"}


def test_probe_reference_is_deterministic_and_learnable():
    w, b = probe_weights(0), probe_batches(1)[0]
    logp = reference_forward(w, b)
    assert logp.shape == (4, 8, 8) and np.allclose(np.exp(logp).sum(-1), 1, atol=1e-5)
    loss = reference_loss(logp, b)
    assert 1.0 < loss < 4.0 and loss == reference_loss(reference_forward(probe_weights(0), b), b)
    assert [layer.path for layer in PROBE] == ["embed", "fc1", "act", "conv", "norm", "head", "logp"]


def test_cast_like_rounds_to_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, 3.0e38, -2.5], np.float32)
    got = cast_like(x, "bfloat16")
    assert got.tolist() == [1.0, 1.0, 1.015625, 1.765625 * 2.0**127, -2.5]
    assert cast_like(x[:3], "float16").dtype == np.float32


def test_cases_cover_every_check_and_policy():
    all_cases = cases()
    per_policy = sum(len(CHECK_POLICIES.get(c.__name__, STANDARD_POLICIES)) for c in CHECKS)
    assert len(all_cases) == per_policy and len(CHECKS) == 12
    from unimp.conformance.fp8 import FP8_CHECKS

    assert {c.__name__ for c in (*CHECKS, *FP8_CHECKS)} == set(CHECK_TAGS), "every check has a row in the tag table"
    assert standard_policy("custom_moved_ops").name == "custom_moved_ops"


def test_param_and_override_fallbacks_follow_the_plan():
    import dataclasses

    p = unimp.load(CUSTOM_MOVED_OPS).replace(param_dtype="bfloat16")
    plan = compile_ops("x", p, control={op: "op" for op in unimp.CANONICAL_OPS}, native={})
    plan = dataclasses.replace(plan, param_fallback="float32", override_fallbacks={0: "float32"})
    exp = expected_layers(p, plan=plan)
    assert exp["fc1"].param_dtype == "float32" and exp["head"].compute_dtype == "float32"
