"""The `unimp` command: located messages, exit codes, and a schema that agrees with the validator."""

import json
import subprocess
import sys

import jsonschema
import pytest

import unimp
from unimp.cli import main
from unimp.policy.loading import preset_path, read_file


def cli(*args):
    return subprocess.run([sys.executable, "-m", "unimp.cli", *args], capture_output=True, text=True, timeout=60)


def test_validate_presets_passes():
    r = cli("validate", *[str(preset_path(n)) for n in unimp.preset_names()])
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("ok  ") == len(unimp.preset_names())


def test_validate_reports_each_problem_located_without_traceback(write):
    good = write("good.toml", 'extends = "mixed_bf16"\n')
    bad = write("bad.toml", '[ops]\nlower = ["matmull"]\n[loss_scale]\nbackoff_factor = 2.0\n')
    r = cli("validate", str(good), str(bad))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert any("bad.toml: ops.lower[0]: unknown op 'matmull' (did you mean 'matmul'?)" in x for x in lines)
    assert any("bad.toml: loss_scale.backoff_factor: must be < 1" in x for x in lines)


def test_show_diff_schema_presets_ops(capsys):
    assert main(["show", "pure_bf16", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["param_dtype"] == "bfloat16"
    assert main(["diff", "mixed_bf16", "mixed_fp16", "--backend", "none-installed"]) == 0
    out = capsys.readouterr().out
    assert "compute_dtype" in out and "loss_scale.mode" in out
    assert main(["presets"]) == 0 and "deepspeed_fp16" in capsys.readouterr().out
    assert main(["ops"]) == 0 and "transcendental" in capsys.readouterr().out


def test_explain_unknown_backend_is_one_line(capsys):
    assert main(["explain", "mixed_bf16", "--backend", "mlx"]) == 1
    assert "not installed" in capsys.readouterr().err


def schema():
    return json.loads(cli("schema").stdout)


@pytest.fixture(scope="module")
def validator():
    s = schema()
    jsonschema.Draft202012Validator.check_schema(s)
    return jsonschema.Draft202012Validator(s)


def test_schema_accepts_every_preset(validator):
    for name in unimp.preset_names():
        errors = list(validator.iter_errors(read_file(preset_path(name))))
        assert not errors, (name, errors[0].message)


@pytest.mark.parametrize("doc", [
    {"ops": {"lower": ["matmull"]}},
    {"loss_scale": {"backoff_factor": 1.5}},
    {"loss_scale": {"growth_interval": 0}},
    {"compute_dtype": "fp8"},
    {"colour": "red"},
    {"overrides": [{"compute_dtype": "float32"}]},
    {"layout": {"align": "8"}},
])
def test_schema_rejects_what_the_validator_rejects(validator, doc):
    with pytest.raises(unimp.PolicyError):
        unimp.load(doc)
    assert list(validator.iter_errors(doc))
