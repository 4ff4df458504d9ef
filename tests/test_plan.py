"""The Plan is the contract: typed decisions compiled once in the core, read back by backends."""

from __future__ import annotations

import warnings

import pytest

import unimp
from unimp.plan import LayerInfo, Plan, compile_ops
from unimp.plan.request import asked_loss_scale
from unimp.policy.ops import class_names, kind_of_names, native_table

INDEX = (LayerInfo("embed", "embedding", ("Embedding",), (("num_embeddings", 32), ("embedding_dim", 16))),
         LayerInfo("fc1", "linear", ("Linear",), (("in_features", 16), ("out_features", 12))),
         LayerInfo("head", "linear", ("Linear",), (("in_features", 12), ("out_features", 8))))


def plan_for(policy, compute=None, **kw):
    return compile_ops("demo", unimp.load(policy), control={}, native={}, compute_dtype=compute, index=INDEX, **kw)


def test_decision_table_is_compiled_once_with_the_resolved_dtype():
    """An auto policy with an auto override: every row carries the resolved dtype, never "auto"."""
    pol = {"extends": "mixed_bf16", "compute_dtype": "auto",
           "overrides": [{"modules": ["head"], "compute_dtype": "auto"}]}
    plan = plan_for(pol, "float16")
    assert [r.decision.compute_dtype for r in plan.layers] == [
        unimp.load(pol).decide("embed", "embedding", (), "float16").compute_dtype, "float16", "float16"]
    assert plan.layer("head").decision.override == 0
    assert plan.decide("fc1", "linear", ("Linear",)) is plan.layer("fc1").decision
    assert plan.decide("late", "linear").compute_dtype == "float16"  # a layer met at run time
    bare = compile_ops("demo", unimp.load(pol), control={}, native={}, compute_dtype="float16")
    assert bare.layers == () and bare.with_index(INDEX) == plan
    with pytest.raises(ValueError, match="'auto' is not resolved.*plan.decide"):
        unimp.load(pol).decide("head", "linear")


def test_ambiguous_overrides_are_reported_in_the_plan():
    pol = {"extends": "mixed_bf16", "overrides": [{"modules": ["h*"], "compute_dtype": "float32"},
                                                  {"types": ["Linear"], "compute_dtype": "float16"},
                                                  {"modules": ["fc1"], "compute_dtype": "float16"}]}
    plan = plan_for(pol)
    assert plan.layer("head").ambiguous == (0, 1) and plan.layer("head").decision.compute_dtype == "float32"
    assert plan.layer("fc1").ambiguous == ()  # overrides 1 and 2 agree
    assert "layer head: overrides #0, #1 all match and disagree; override #0 wins" in str(plan)


def test_loss_scale_is_resolved_in_the_plan():
    pol = unimp.load({"extends": "fp32", "compute_dtype": "auto"})
    assert pol.loss_scale.mode == "none"
    assert plan_for(pol, "float16").loss_scale.mode == "dynamic"
    assert pol.loss_scale == asked_loss_scale(pol, "float32") and pol.loss_scale.initial_auto
    # the Plan runs the policy's spec, its initial = "auto" resolved (2^16 on a backend that declares no other)
    assert plan_for(pol, "float32").loss_scale == pol.loss_scale.starting_at(2.0 ** 16)
    assert not plan_for(pol, "float32").loss_scale.initial_auto
    assert plan_for(pol, "float16").to_dict()["loss_scale"]["mode"] == "dynamic"


@pytest.mark.parametrize("action", ["ignore", "warn", "error"])
def test_one_on_misaligned_action(action):
    plan = plan_for({"extends": "mixed_bf16", "layout": {"align": 8, "on_misaligned": action}})
    assert plan.layout.findings == ("fc1: out_features=12 is not a multiple of 8",
                                    "head: in_features=12 is not a multiple of 8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if action == "error":
            with pytest.raises(unimp.UnsupportedError, match=r"(?s)fc1: out_features=12.*head: in_features.*fix"):
                plan.layout.act("demo")
            return
        kept = plan.layout.act("demo")
    assert kept == (() if action == "ignore" else plan.layout.findings)
    assert bool(caught) == (action == "warn") and all(issubclass(w.category, unimp.UnimpWarning) for w in caught)


def test_details_are_typed():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Demo:
        autocast: str | None

    plan = plan_for("mixed_bf16", details=Demo("bfloat16"))
    assert plan.details.autocast == "bfloat16" and plan.to_dict()["details"] == {"autocast": "bfloat16"}


def test_class_walk_and_native_table():
    class Dense: ...

    class MyDense(Dense): ...

    table = native_table("demo", {"linear": ["Dense"]})
    assert kind_of_names(class_names(MyDense), table) == "linear"
    assert class_names(MyDense, stop=(Dense,)) == ("MyDense",)
    with pytest.raises(ValueError, match="'linaer' \\(did you mean 'linear'\\?\\)"):
        native_table("demo", {"linaer": ["Dense"]})


def test_the_request_resolves_the_overrides_for_every_backend():
    """What a backend asks of the request, answered by the core: ``auto`` overrides follow the resolved compute
    dtype, the explicit ones keep theirs, each named as its setting; one layer's answer says which override set it."""
    pol = unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto",
                      "overrides": [{"types": ["Linear"], "compute_dtype": "auto"},
                                    {"modules": ["head"], "compute_dtype": "float32", "param_dtype": "float32"},
                                    {"modules": ["embed"], "param_dtype": "bfloat16"}]})
    request = Plan.request(pol, "demo")
    assert request.compute_dtype == "auto" and request.at("float16").compute_dtype == "float16"
    at = request.at("float16")
    assert [(r.setting, r.dtype, r.follows_compute) for r in at.override_dtypes] == [
        ("overrides[0].compute_dtype", "float16", True), ("overrides[1].compute_dtype", "float32", False),
        ("overrides[1].param_dtype", "float32", False), ("overrides[2].param_dtype", "bfloat16", False)]
    assert at.compute_requests() == (("compute_dtype", "float16"), ("overrides[1].compute_dtype", "float32"))
    assert at.low_dtypes == ("float16",) and at.mixes_compute
    assert not Plan.request(unimp.load("mixed_bf16"), "demo").mixes_compute
    fc, embed = at.decide("fc1", "linear", ("Linear",)), at.decide("embed", "embedding", ("Embedding",))
    assert (fc.compute_dtype, fc.override, fc.sets_compute) == ("float16", 0, True)
    assert (embed.param_dtype, embed.override, embed.sets_compute) == ("bfloat16", 2, False)
    plan = at.compile(control={}, native={}, index=INDEX)
    assert plan.compute_dtype == "float16" and plan.decide("fc1", "linear", ("Linear",)) == fc
    assert not hasattr(plan, "overrides") and not hasattr(request, "overrides")


def test_the_plan_has_one_loss_scale_the_spec_that_runs():
    """``plan.loss_scale`` is what the backend runs: the knobs it cannot honour replaced (noted), ``auto``
    resolved; the report (``to_dict``) keeps the spec as asked, its fallbacks in the notes."""
    pol = unimp.load({"extends": "mixed_fp16", "loss_scale": {"scale_dtype": "float64"}, "on_unsupported": "fallback"})
    plan = plan_for(pol, loss_scale_unsupported={"scale_dtype": ("float32", "the demo holds float32 scales")})
    assert plan.loss_scale.scale_dtype == "float32" and pol.loss_scale.scale_dtype == "float64"
    assert plan.to_dict()["loss_scale"]["scale_dtype"] == "float64"
    assert any("scale_dtype" in n for n in plan.notes)
    assert not any(hasattr(plan, n) for n in ("as_run", "loss_scale_at"))
    with pytest.warns(DeprecationWarning, match="plan.loss_scale is the loss-scale spec that runs"):
        assert plan.loss_scale_run == plan.loss_scale  # the old name, for code that read it
