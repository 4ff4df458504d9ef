"""Policy loading, extends, validation messages, immutability and round trips."""

import json
from pathlib import Path

import pytest

import unimp
from unimp import PolicyError

TEAM_TOML = """
name = "team"
extends = "mixed_bf16"
[loss_scale]
growth_interval = 100
[[overrides]]
modules = ["*.norm*", "head"]
types = ["Embedding"]
compute_dtype = "float32"
"""
TEAM = {"name": "team", "extends": "mixed_bf16", "loss_scale": {"growth_interval": 100},
        "overrides": [{"modules": ["*.norm*", "head"], "types": ["Embedding"], "compute_dtype": "float32"}]}


def test_every_preset_loads_and_names_itself():
    names = unimp.preset_names()
    for expected in ("fp32", "mixed_fp16", "mixed_bf16", "pure_bf16", "fp16_master", "torch_autocast_cuda",
                     "torch_autocast_cpu", "keras_mixed_float16", "paddle_o1", "paddle_o2", "apex_o1",
                     "apex_o2", "deepspeed_fp16", "deepspeed_zero_fp16"):
        assert expected in names
    for n in names:
        assert unimp.load(n).name == n


def test_same_fingerprint_from_toml_yaml_json_and_dict(write):
    import yaml

    toml = write("team.toml", TEAM_TOML)
    ymlp = write("team.yaml", yaml.safe_dump(TEAM))
    jsp = write("team.json", json.dumps(TEAM))
    fps = {unimp.load(toml).fingerprint, unimp.load(ymlp).fingerprint, unimp.load(jsp).fingerprint,
           unimp.load(TEAM).fingerprint}
    assert len(fps) == 1
    assert unimp.load(TEAM).fingerprint != unimp.load("mixed_bf16").fingerprint


def test_int_and_float_spellings_fingerprint_alike():
    a = unimp.load({"loss_scale": {"initial": 1024}})
    b = unimp.load({"loss_scale": {"initial": 1024.0}})
    assert a.fingerprint == b.fingerprint and isinstance(a.loss_scale.initial, float)


def test_name_is_not_part_of_the_fingerprint():
    assert unimp.load({"name": "a"}).fingerprint == unimp.load({"name": "b"}).fingerprint


def test_minimal_file_is_valid(write):
    p = unimp.load(write("x.toml", 'name = "x"\nextends = "mixed_bf16"\n'))
    assert p.name == "x" and p.compute_dtype == "bfloat16"
    assert unimp.load({}).loss_scale.growth_interval == 2000


def test_extends_relative_path_recursive(write):
    write("base/a.toml", 'extends = "mixed_fp16"\n[loss_scale]\ninitial = 1024.0\n')
    write("base/b.toml", 'extends = "a.toml"\n[loss_scale]\ngrowth_interval = 10\n')
    top = write("top.toml", 'extends = "base/b.toml"\nname = "top"\n')
    p = unimp.load(top)
    assert (p.compute_dtype, p.loss_scale.initial, p.loss_scale.growth_interval) == ("float16", 1024.0, 10)


def test_extends_cycle_is_refused(write):
    write("a.toml", 'extends = "b.toml"\n')
    write("b.toml", 'extends = "a.toml"\n')
    with pytest.raises(PolicyError, match="cycle"):
        unimp.load(write("c.toml", 'extends = "a.toml"\n'))


def test_self_extends_is_a_cycle(write):
    p = write("self.toml", 'extends = "self.toml"\n')
    with pytest.raises(PolicyError, match="cycle"):
        unimp.load(p)


def test_tables_merge_and_lists_replace():
    p = unimp.load({"extends": "mixed_fp16", "loss_scale": {"initial": 8.0}, "ops": {"promote": ["concat"]}})
    assert p.loss_scale.mode == "dynamic" and p.loss_scale.initial == 8.0
    assert p.ops.promote == ("concat",) and p.ops.category("elementwise") == "inputs"


def test_moving_an_op_leaves_the_parents_other_lists():
    p = unimp.load({"extends": "mixed_bf16", "ops": {"lower": ["matmul", "softmax"]}})
    assert p.ops.category("softmax") == "lower"
    assert "softmax" not in p.ops.float32
    assert p.ops.category("linear") == "inputs"  # the child's list replaced the parent's
    assert p.ops.category("layer_norm") == "float32"


def test_op_in_two_lists_of_one_file_is_an_error():
    with pytest.raises(PolicyError, match=r"<dict>: ops.float32\[0\]: 'softmax' is already in ops.lower"):
        unimp.load({"ops": {"lower": ["softmax"], "float32": ["softmax"]}})


@pytest.mark.parametrize("bad, where, what", [
    ({"ops": {"lower": ["matmul", "linear", "matmull"]}}, "ops.lower[2]", "did you mean 'matmul'"),
    ({"loss_scale": {"growth_factor": 1.0}}, "loss_scale.growth_factor", "must be > 1"),
    ({"loss_scale": {"backoff_factor": 0.0}}, "loss_scale.backoff_factor", "must be > 0"),
    ({"loss_scale": {"backoff_factor": 1.0}}, "loss_scale.backoff_factor", "must be < 1"),
    ({"loss_scale": {"min": 10.0, "initial": 2.0}}, "loss_scale.min", "above initial"),
    ({"loss_scale": {"initial": float("nan")}}, "loss_scale.initial", "NaN"),
    ({"loss_scale": {"initial": float("inf")}}, "loss_scale.initial", "finite"),
    ({"loss_scale": {"growth_interval": 0}}, "loss_scale.growth_interval", ">= 1"),
    ({"loss_scale": {"growth_interval": 2.5}}, "loss_scale.growth_interval", "integer"),
    ({"loss_scale": {"growth_intervall": 5}}, "loss_scale", "did you mean 'growth_interval'"),
    ({"compute_dtype": "bf16"}, "compute_dtype", "not one of"),
    ({"compute_dtype": "bfloat"}, "compute_dtype", "did you mean 'bfloat16'"),
    ({"output_dtype": "unchange"}, "output_dtype", "did you mean 'unchanged'"),
    ({"output_dtype": "auto"}, "output_dtype", "not one of"),
    ({"layout": {"channels_last": "yes"}}, "layout.channels_last", "true or false"),
    ({"colour": "red"}, "", "unknown key 'colour'"),
    ({"overrides": [{"compute_dtype": "float32"}]}, "overrides[0]", "matches nothing"),
    ({"overrides": [{"modules": ["x"]}, {"modules": []}]}, "overrides[0]", "changes nothing"),
    ({"overrides": [{"modules": ["a"], "compute_dtype": "float32"}, {"modules": "b", "compute_dtype": "float32"}]},
     "overrides[1].modules", "expected a list"),
    ({"overrides": [{"types": ["layernorm"], "compute_dtype": "float32"}]}, "overrides[0].types[0]",
     "did you mean 'layer_norm'"),
    ({"extends": "mixed_bf17"}, "extends", "did you mean 'mixed_bf16'"),
])
def test_errors_name_source_key_path_and_fix(bad, where, what):
    with pytest.raises(PolicyError) as e:
        unimp.load(bad)
    text = str(e.value)
    assert text.startswith("<dict>: ")
    assert f": {where}: " in text or (where == "" and "<dict>: unknown key" in text)
    assert what in text


def test_file_errors_name_the_file(write):
    p = write("bad.toml", '[loss_scale]\ngrowth_factor = 0.5\n')
    with pytest.raises(PolicyError, match=r"bad.toml: loss_scale.growth_factor: must be > 1"):
        unimp.load(p)
    with pytest.raises(PolicyError, match=r"broken.toml: not valid TOML"):
        unimp.load(write("broken.toml", "name = \n"))
    with pytest.raises(PolicyError, match=r"no such file"):
        unimp.load("missing/policy.toml")
    with pytest.raises(PolicyError, match=r"unknown file type '.txt'"):
        unimp.load(write("p.txt", "x"))


def test_policy_is_immutable_and_replace_revalidates():
    p = unimp.load("mixed_bf16")
    with pytest.raises(AttributeError):
        p.compute_dtype = "float16"
    q = p.replace(loss_scale={"mode": "static", "initial": 128.0})
    assert q.loss_scale.mode == "static" and q.loss_scale.growth_interval == p.loss_scale.growth_interval
    assert p.loss_scale.mode == "none"
    with pytest.raises(PolicyError, match="loss_scale.initial"):
        p.replace(loss_scale={"initial": -1.0})


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_dump_round_trip(tmp_path, suffix):
    p = unimp.load(TEAM)
    path = unimp.dump(p, tmp_path / f"out{suffix}")
    q = unimp.load(path)
    assert q == p and q.fingerprint == p.fingerprint


def test_dump_round_trip_with_infinite_max(tmp_path):
    p = unimp.load("torch_autocast_cuda")
    for suffix in (".toml", ".yaml", ".json"):
        assert unimp.load(unimp.dump(p, tmp_path / f"t{suffix}")).fingerprint == p.fingerprint


def test_decide_layers():
    p = unimp.load(TEAM)
    assert p.decide("encoder.fc", "linear").compute_dtype == "bfloat16"
    assert p.decide("encoder.norm1", "layer_norm").compute_dtype == "float32"
    assert p.decide("head", "linear").compute_dtype == "float32"  # module glob override
    assert p.decide("tok", "embedding", ["Embedding"]).compute_dtype == "float32"  # type override
    assert p.decide("act", "activation").compute_dtype is None  # follows inputs
    pure = unimp.load("pure_bf16")
    assert pure.decide("fc", "linear").param_dtype == "bfloat16"
    assert pure.decide("ln", "layer_norm").param_dtype == "float32"
    assert pure.uses_master_weights and not unimp.load("mixed_bf16").uses_master_weights


def test_load_rejects_other_argument_types():
    with pytest.raises(PolicyError, match="expected a policy file path"):
        unimp.load(42)


def test_presets_ship_a_source_comment():
    root = Path(unimp.policy.loading.preset_path("fp32")).parent
    for f in root.glob("*.toml"):
        assert f.read_text().startswith("# "), f"{f.name} needs a comment saying what it reproduces"


def test_dynamic_mode_turns_skipping_on_unless_the_file_says_otherwise():
    assert unimp.load({"extends": "mixed_bf16", "loss_scale": {"mode": "dynamic"}}).loss_scale.skip_nonfinite
    assert unimp.load("mixed_bf16").replace(loss_scale={"mode": "dynamic"}).loss_scale.skip_nonfinite
    assert not unimp.load({"extends": "mixed_fp16", "loss_scale": {"mode": "static", "skip_nonfinite": False}}
                          ).loss_scale.skip_nonfinite


def test_dynamic_without_skipping_warns():
    with pytest.warns(unimp.UnimpWarning, match="loss_scale.skip_nonfinite: false with mode = 'dynamic'"):
        unimp.load({"extends": "mixed_bf16", "loss_scale": {"mode": "dynamic", "skip_nonfinite": False}})
