"""The [fp8] table: validation, schema, presets, the Plan's Fp8Plan, the per-layer decision, reports, CLI."""

import json
import re

import jsonschema
import pytest

import unimp
from unimp.backend import Backend
from unimp.cli import main
from unimp.errors import PolicyError, UnsupportedError
from unimp.plan import compile_ops
from unimp.plan.fp8 import Fp8Support, decide_fp8, plan_fp8
from unimp.policy.loading import preset_path
from unimp.policy.spec import json_schema
from unimp.report import Report, ReportRow

FP8_PRESETS = {  # preset -> (recipe, gradient format, amax history, the native system its header names)
    "fp8_tensorwise": ("tensorwise", "e5m2", 16, "torchao"),
    "fp8_rowwise": ("rowwise", "e4m3", 16, "torchao"),
    "fp8_delayed": ("delayed", "e5m2", 16, "Transformer Engine"),
    "torchao_float8": ("tensorwise", "e5m2", 16, "Float8LinearConfig"),
    "te_delayed": ("delayed", "e5m2", 1024, "DelayedScaling"),
    "keras_float8": ("delayed", "e5m2", 1024, "quantize(\"float8\")"),
}
LINEAR = ("Linear",)
OK_DIMS = {"in_features": 64, "out_features": 128}


class Fp8ToyBackend(Backend):
    """A pure-Python backend that runs tensorwise and rowwise FP8 for linear layers only."""

    name = "fp8toy"
    framework = "unimp_fp8toy_framework_never_imported"
    distribution = "unimp-fp8toy"
    model_types = "nothing"
    support = Fp8Support(ops=("linear",), recipes={"tensorwise": "toy tensorwise", "rowwise": "toy rowwise"},
                         why_not={"delayed": "toy dropped delayed scaling"})

    def accepts(self, model):
        return False

    def plan(self, request, model=None):
        return request.compile(control={"linear": "op"}, native={}, fp8=self.support)

    def apply(self, plan, model, optimizer=None, **options):
        raise NotImplementedError


@pytest.fixture
def toy():
    unimp.register_backend(Fp8ToyBackend)
    return Fp8ToyBackend()


# ---------------------------------------------------------------- presets and the file format

@pytest.mark.parametrize("name", sorted(FP8_PRESETS))
def test_fp8_presets_load_and_name_their_source(name):
    recipe, grad, history, system = FP8_PRESETS[name]
    p = unimp.load(name)
    assert (p.fp8.enabled, p.fp8.recipe, p.fp8.gradient_format, p.fp8.amax_history) == (True, recipe, grad, history)
    assert (p.fp8.ops, p.fp8.forward_format, p.fp8.dims_multiple, p.compute_dtype) == (
        ("linear",), "e4m3", 16, "bfloat16")
    header = preset_path(name).read_text().split("name =")[0]
    assert "source:" in header and system in header


def test_policies_without_fp8_keep_their_fingerprint():
    """Writing the [fp8] defaults changes nothing (so checkpoints from before [fp8] still load strictly);
    enabling it is a different policy."""
    base = unimp.load("mixed_bf16")
    spelled = unimp.load({"extends": "mixed_bf16", "fp8": {"enabled": False, "recipe": "tensorwise"}})
    assert spelled.fingerprint == base.fingerprint
    assert unimp.load({"extends": "mixed_bf16", "fp8": {"enabled": True}}).fingerprint != base.fingerprint
    assert unimp.load(base.to_dict()).fp8 == base.fp8


@pytest.mark.parametrize(("doc", "located"), [
    ({"fp8": {"recipe": "tensorwize"}}, r"fp8\.recipe: 'tensorwize' is not one of .*did you mean 'tensorwise'"),
    ({"fp8": {"ops": ["conv"]}}, r"fp8\.ops\[0\]: 'conv' is not one of linear, matmul, attention"),
    ({"fp8": {"gradient_format": "e3m4"}}, r"fp8\.gradient_format: 'e3m4' is not one of e5m2, e4m3"),
    ({"fp8": {"forward_format": "e5m2"}}, r"fp8\.forward_format: 'e5m2' is not one of e4m3"),
    ({"fp8": {"dims_multiple": 0}}, r"fp8\.dims_multiple: must be >= 1"),
    ({"fp8": {"amax_history": 0, "recipe": "delayed"}}, r"fp8\.amax_history: must be >= 1"),
    ({"fp8": {"enabled": "yes"}}, r"fp8\.enabled: expected true or false"),
    ({"fp8": {"recipie": "rowwise"}}, r"fp8: unknown key 'recipie' \(did you mean 'recipe'\?\)"),
    ({"fp8": {"enabled": True, "amax_history": 1024}}, r"fp8\.amax_history: applies to recipe = 'delayed' only"),
    ({"overrides": [{"modules": ["head"], "fp8": 1}]}, r"overrides\[0\]\.fp8: expected true or false"),
    ({"overrides": [{"modules": ["head"]}]}, r"overrides\[0\]: changes nothing: give compute_dtype, param_dtype "
                                             r"and/or fp8"),
])
def test_bad_fp8_input_is_a_located_error(doc, located):
    with pytest.raises(PolicyError) as e:
        unimp.load({"extends": "mixed_bf16", **doc})
    assert re.search(located, str(e.value)), str(e.value)


def test_schema_covers_fp8_and_agrees_with_the_validator():
    schema = json_schema()
    validator = jsonschema.Draft202012Validator(schema)
    fp8 = schema["properties"]["fp8"]["properties"]
    assert fp8["recipe"]["enum"] == ["tensorwise", "rowwise", "rowwise_gw_hp", "delayed"]
    assert fp8["ops"]["items"]["enum"] == ["linear", "matmul", "attention"]
    assert schema["properties"]["overrides"]["items"]["properties"]["fp8"]["type"] == "boolean"
    good = {"fp8": {"enabled": True, "recipe": "rowwise_gw_hp", "gradient_format": "e4m3"},
            "overrides": [{"modules": ["lm_head"], "fp8": False}]}
    assert not list(validator.iter_errors(good))
    unimp.load(good)
    for bad in ({"fp8": {"recipe": "mxfp8"}}, {"fp8": {"dims_multiple": 0}}, {"fp8": {"ops": ["conv"]}},
                {"overrides": [{"modules": ["x"], "fp8": "no"}]}):
        assert list(validator.iter_errors(bad)), bad
        with pytest.raises(PolicyError):
            unimp.load(bad)


# ---------------------------------------------------------------- the per-layer decision

def test_decide_fp8_rules_in_order():
    policy = unimp.load({"extends": "fp8_tensorwise", "overrides": [
        {"modules": ["lm_head"], "fp8": False},
        {"modules": ["*.norm*", "head32"], "compute_dtype": "float32"},
        {"modules": ["gate"], "fp8": True}]})
    ok = decide_fp8(policy, "mlp.up", "linear", LINEAR, OK_DIMS)
    assert (ok.fp8, ok.recipe) == (True, "tensorwise")
    off = decide_fp8(policy, "lm_head", "linear", LINEAR, OK_DIMS)
    assert (off.fp8, off.reason) == (False, "overrides[0] sets fp8 = false")
    f32 = decide_fp8(policy, "head32", "linear", LINEAR, OK_DIMS)
    assert not f32.fp8 and f32.reason == "overrides[1] runs it in float32"
    dims = decide_fp8(policy, "proj", "linear", LINEAR, {"in_features": 24, "out_features": 40})
    assert not dims.fp8 and dims.reason.startswith("in_features=24, out_features=40 are not a multiple of "
                                                   "fp8.dims_multiple (16); stays in bfloat16")
    conv = decide_fp8(policy, "stem", "conv", ("Conv2d",), {"in_channels": 16})
    assert (conv.fp8, conv.reason) == (False, "conv is not in fp8.ops")
    # an fp8-only override does not hide the dtype overrides after it
    assert policy.decide("block.norm1", "layer_norm", ("LayerNorm",)).override == 1


def test_override_fp8_true_without_the_table():
    policy = unimp.load({"extends": "mixed_bf16", "overrides": [{"modules": ["mlp.*"], "fp8": True}]})
    assert decide_fp8(policy, "mlp.up", "linear", LINEAR, OK_DIMS).fp8
    other = decide_fp8(policy, "attn.q", "linear", LINEAR, OK_DIMS)
    assert not other.fp8 and "fp8.enabled = false" in other.reason
    assert not decide_fp8(unimp.load("mixed_bf16"), "mlp.up", "linear", LINEAR, OK_DIMS).fp8


def test_dims_multiple_is_the_policys():
    policy = unimp.load({"extends": "fp8_tensorwise", "fp8": {"dims_multiple": 8}})
    assert decide_fp8(policy, "fc", "linear", LINEAR, {"in_features": 24, "out_features": 40}).fp8


# ---------------------------------------------------------------- the Plan: what a backend can run

def test_plan_carries_fp8_and_explain_shows_it(toy, capsys):
    plan = toy.compile(unimp.load("fp8_tensorwise"))
    assert (plan.fp8.active, plan.fp8.recipe, plan.fp8.native) == (True, "tensorwise", "toy tensorwise")
    assert plan.to_dict()["fp8"]["recipe"] == "tensorwise"
    assert decide_fp8(plan, "fc", "linear", LINEAR, OK_DIMS).fp8
    assert main(["explain", "fp8_tensorwise", "--backend", "fp8toy"]) == 0
    out = capsys.readouterr().out
    assert "fp8: recipe tensorwise (e4m3 forward, e5m2 gradients) for linear" in out
    assert "fp8: runs as toy tensorwise" in out
    assert not toy.compile(unimp.load("mixed_bf16")).fp8.requested


def test_recipe_the_backend_lacks_is_refused_or_a_reported_fallback(toy):
    with pytest.raises(UnsupportedError, match=r"fp8\.recipe = 'delayed': backend fp8toy cannot run it \(toy "
                                               r"dropped delayed scaling\); it runs tensorwise, rowwise"):
        toy.compile(unimp.load("fp8_delayed"))
    plan = toy.compile(unimp.load({"extends": "fp8_delayed", "on_unsupported": "fallback"}))
    assert plan.fp8.requested and not plan.fp8.active and "toy dropped delayed scaling" in plan.fp8.fallback
    d = decide_fp8(plan, "fc", "linear", LINEAR, OK_DIMS)
    assert not d.fp8 and "toy dropped delayed scaling" in d.reason
    assert "fp8: fallback to the compute dtype" in str(plan)


def test_ops_the_backend_lacks(toy):
    doc = {"extends": "fp8_tensorwise", "fp8": {"ops": ["linear", "attention"]}}
    with pytest.raises(UnsupportedError, match=r"fp8\.ops: 'attention': backend fp8toy runs FP8 only for linear"):
        toy.compile(unimp.load(doc))
    plan = toy.compile(unimp.load({**doc, "on_unsupported": "fallback"}))
    assert plan.fp8.active and plan.fp8.ops == ("linear",)
    assert any("attention" in n for n in plan.fp8.notes)


def test_backend_without_fp8_refuses_naming_it():
    plan_args = {"control": {"linear": "op"}, "native": {}}
    with pytest.raises(UnsupportedError, match="backend bare has no FP8 training path"):
        compile_ops("bare", unimp.load("fp8_tensorwise"), **plan_args)
    fb = compile_ops("bare", unimp.load({"extends": "fp8_tensorwise", "on_unsupported": "fallback"}), **plan_args)
    assert not fb.fp8.active and fb.fp8.fallback == "backend bare has no FP8 training path"
    assert compile_ops("bare", unimp.load("mixed_bf16"), **plan_args).fp8.requested is False
    assert plan_fp8(unimp.load("fp8_rowwise"), "any", Fp8Support.everything()).active


def test_diff_shows_fp8_per_backend(toy, capsys):
    assert main(["diff", "fp8_tensorwise", "fp8_rowwise", "--backend", "fp8toy"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"fp8\.recipe\s+\"tensorwise\"\s+\"rowwise\"", out)
    assert re.search(r"fp8\s+tensorwise e4m3/e5m2 on linear \(dims % 16\)\s+rowwise e4m3/e4m3 on linear", out)
    assert main(["diff", "mixed_bf16", "fp8_tensorwise", "--backend", "fp8toy"]) == 0
    assert re.search(r"fp8\s+off\s+tensorwise", capsys.readouterr().out)


# ---------------------------------------------------------------- reports

def test_report_rows_say_which_layers_ran_fp8():
    rows = [ReportRow("up", "linear", "bfloat16", "float32", "bfloat16", fp8="tensorwise"),
            ReportRow("head", "linear", "bfloat16", "float32", "bfloat16")]
    r = Report(rows, backend="torch")
    back = Report.from_json(r.to_json())
    assert [x.fp8 for x in back.rows] == ["tensorwise", None]
    assert json.loads(r.to_json())["rows"][0]["fp8"] == "tensorwise"
    text = str(r).splitlines()
    assert text[1].split() == ["path", "kind", "compute", "params", "output", "fp8"]
    assert text[2].split()[-1] == "tensorwise" and text[3].split()[-1] == "-"
    other = Report([rows[0], ReportRow("head", "linear", "bfloat16", "float32", "bfloat16", fp8="rowwise")])
    assert r.diff(other) == ["head: fp8 None != rowwise"]
    assert "fp8" not in str(Report(rows[1:])).splitlines()[1]  # no FP8 anywhere: no column
