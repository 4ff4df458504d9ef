"""unimp.sensitivity / unimp.tune / `unimp tune` through the NumPy sixth backend (float16 only): the effect of
lowering one layer alone against a forward run by hand, a planted float16 overflow kept in float32, the
combined budget's binary search on layers whose losses add up exactly, the policy file, and bad input."""

from __future__ import annotations

import math
import sys
import tomllib
import warnings
from pathlib import Path

import numpy as np
import pytest

import unimp
from unimp.cli import main
from unimp.errors import TuneError, UnimpWarning, UnsupportedError

sys.path.insert(0, str(Path(__file__).parent / "sixth_backend"))
from unimp_numpy import nn
from unimp_numpy.backend import NumpyBackend

if "numpy" not in unimp.backends():
    unimp.register_backend(NumpyBackend)

FP16_MAX = 65504.0  # the largest float16
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                        "ignore:invalid value encountered:RuntimeWarning")


def planted() -> nn.Model:
    """fc -> act -> shrink -> big -> down, every activation well inside float16's range, but ``big``'s weights (1e5)
    are not: lowered, it gives inf."""
    rng = np.random.default_rng(0)
    return nn.Model([("fc", nn.Linear(rng.normal(size=(8, 8)) / 3, np.zeros(8))), ("act", nn.ReLU()),
                     ("shrink", nn.Linear(rng.normal(size=(8, 8)) * 1e-3, np.zeros(8))),
                     ("big", nn.Linear(np.full((8, 8), 1e5), np.zeros(8))),
                     ("down", nn.Linear(rng.normal(size=(8, 8)) / 3, np.zeros(8)))])


BATCHES = [np.random.default_rng(i).normal(size=(6, 8)).astype(np.float32) for i in range(3)]


def loss_fn(model, x):
    return float(np.square(model(x).astype(np.float32)).mean())


def by_hand(model: nn.Model, dtypes: dict[str, str]) -> float:
    """The mean loss with each layer computing in ``dtypes[path]`` (a layer not named follows its input)."""
    losses = []
    for x in BATCHES:
        for path, layer in model.layers:
            x = layer.forward(x, dtypes.get(path, x.dtype.name))
        losses.append(float(np.square(x.astype(np.float32)).mean()))
    return sum(losses) / len(losses)


def params(model: nn.Model) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in model.named_params().items()}


def test_each_layer_alone_against_a_forward_by_hand():
    model = planted()
    before = params(model)
    table = unimp.sensitivity("mixed_fp16", model, BATCHES, loss_fn)
    assert table.rows[0].path == "big" and {r.path for r in table.rows} == {"big", "fc", "shrink", "down"}
    assert [r.divergence for r in table.rows] == sorted((r.divergence for r in table.rows), reverse=True)
    assert big_weights_overflow()
    assert table.rows[0].divergence == math.inf and not math.isfinite(table.rows[0].loss)
    f32 = {"fc": "float32", "shrink": "float32", "big": "float32", "down": "float32"}  # `act` follows its input
    assert table.reference_loss == pytest.approx(by_hand(model, f32), rel=1e-6)
    for path in ("fc", "shrink", "down"):  # the layer in float16, everything after it as the reference runs it
        alone = by_hand(model, {**f32, path: "float16"})
        row = table.row(path)
        assert row.loss == pytest.approx(alone, rel=1e-6)
        assert row.change == pytest.approx(alone / table.reference_loss - 1, abs=1e-9)
        assert row.divergence >= abs(row.change) and row.lowered_to == "float16"
    assert table.target == "float16" and table.high == "float32" and table.noise == 0
    assert table.evaluations == 3 + 4  # the reference twice, the policy as given, one per candidate
    assert all(np.array_equal(v, before[k]) for k, v in model.named_params().items())  # ran on copies
    unimp.apply("fp32", model).remove()  # and the model was never left applied
    assert "fc" in str(table) and "most sensitive first" in str(table)


def big_weights_overflow() -> bool:
    """The plant, checked independently: float16 cannot hold big's weights."""
    return bool(np.isinf(planted().layers[3][1].params["weight"].astype(np.float16)).all()) and FP16_MAX < 1e5


def test_tune_keeps_the_planted_layer_in_float32(tmp_path):
    model = planted()
    tuned = unimp.tune("mixed_fp16", model, BATCHES, loss_fn)
    assert [k.layer.path for k in tuned.kept] == ["big"] and {r.path for r in tuned.lowered} == {"fc", "shrink", "down"}
    assert tuned.policy.overrides[0].modules == ("big",) and tuned.policy.overrides[0].compute_dtype == "float32"
    again = unimp.load(tomllib.loads(tuned.text))  # the file is an ordinary policy
    assert again.fingerprint == tuned.policy.fingerprint
    assert 'extends = "mixed_fp16"' in tuned.text
    comment = next(line for line in tuned.text.splitlines() if line.startswith("# big:"))
    assert "divergence inf" in comment and "kept in float32" in comment
    assert "# Lowered to float16 by the policy (3 layers):" in tuned.text
    amp = unimp.apply(tuned.policy, planted())
    report = amp.report(BATCHES[0])
    assert [report.row(p).compute_dtype for p in ("fc", "shrink", "big", "down")] == [
        "float16", "float16", "float32", "float16"]
    assert math.isfinite(loss_fn(amp.model, BATCHES[0]))
    amp.remove()
    assert tuned.divergence <= 0.01 and tuned.loss == pytest.approx(
        by_hand(model, {"fc": "float16", "shrink": "float16", "big": "float32", "down": "float16"}), rel=1e-6)
    path = tuned.write(tmp_path / "tuned.toml")
    assert unimp.load(path).fingerprint == tuned.policy.fingerprint


DELTA = 0.125  # exact in float16 and float32; lost in float16 next to 1024 (its spacing there: 0.5, then 1)


def adders(n: int = 4, width: int = 8) -> tuple[nn.Model, list[np.ndarray]]:
    """n identity layers on ``width`` features (the first n 1024, the rest 0); layer j turns feature j from 1024 into
    DELTA (bias DELTA - 1024): float16 rounds that bias to -1024, so each lowered layer loses exactly DELTA of the
    output, whichever others are lowered."""
    layers = []
    for j in range(n):
        bias = np.zeros(width)
        bias[j] = DELTA - 1024
        layers.append((f"add{j}", nn.Linear(np.eye(width), bias)))
    x = np.zeros((2, width), np.float32)
    x[:, :n] = 1024.0
    return nn.Model(layers), [x]


def mean_output(model, x):
    return float(model(x).astype(np.float32).mean())


def test_the_combined_budget_lowers_the_longest_prefix_within_it():
    model, batches = adders(4)
    table = unimp.sensitivity("mixed_fp16", model, batches, mean_output)
    assert table.reference_loss == 4 * DELTA / 8  # four features DELTA, four 0
    assert [r.divergence for r in table.rows] == [0.25] * 4  # one of four DELTAs lost
    assert table.lowered_divergence == 1.0  # all lost: each alone is within 0.6, together they are not
    tuned = unimp.tune("mixed_fp16", model, batches, mean_output, max_loss_increase=0.6)
    assert [r.path for r in tuned.lowered] == ["add0", "add1"]  # 2 of 4 lost = 0.5 <= 0.6 < 0.75 = 3 of 4
    assert tuned.divergence == 0.5 and tuned.loss == 2 * DELTA / 8
    assert [k.layer.path for k in tuned.kept] == ["add2", "add3"]
    assert all("lowered with the 2 less sensitive layers: divergence 75.000%" in k.reason for k in tuned.kept)
    runs = tuned.sensitivity.evaluations
    assert runs <= 3 + 4 + math.ceil(math.log2(4)) + 2  # sensitivity, then the bounded search


def test_paths_are_matched_literally_and_the_policys_own_overrides_follow():
    rng = np.random.default_rng(1)
    model = nn.Model([("blk[0]", nn.Linear(rng.normal(size=(8, 8)), np.zeros(8))),
                      ("blk0", nn.Linear(np.full((8, 8), 1e5), np.zeros(8))),
                      ("head", nn.Linear(rng.normal(size=(8, 8)) * 1e-5, np.zeros(8)))])
    policy = unimp.load({"name": "team", "extends": "mixed_fp16", "overrides": [
        {"modules": ["head"], "compute_dtype": "float32"}]})
    tuned = unimp.tune(policy, model, BATCHES, loss_fn)
    assert [k.layer.path for k in tuned.kept] == ["blk0"]  # `head` is the policy's float32: no candidate
    assert [o.modules for o in tuned.policy.overrides] == [("blk0",), ("head",)]
    assert "extends" not in tuned.text and "the overrides of policy 'team'" in tuned.text  # no preset: in full
    text = tuned.text.replace('modules = ["blk0"]', 'modules = ["blk[[]0]"]')  # the escaped glob of blk[0]
    amp = unimp.apply(unimp.load(tomllib.loads(text)), model)
    report = amp.report(BATCHES[0])
    assert [report.row(p).compute_dtype for p in ("blk[0]", "blk0", "head")] == ["float32", "float16", "float32"]
    amp.remove()


def test_a_nondeterministic_loss_is_pointed_out():
    rng = np.random.default_rng(0)
    with pytest.warns(UnimpWarning, match="eval mode"):
        table = unimp.sensitivity("mixed_fp16", planted(), BATCHES, lambda m, x: loss_fn(m, x) * (1 + rng.random()))
    assert table.noise > 0 and "noise: two reference runs differ" in str(table)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_layers": 3}, "lowers 4 layers of this model, more than max_layers=3"),
    ({"max_batches": 2}, "batches holds more than max_batches=2"),
    ({"max_batches": 0}, r"max_batches=an integer 0: expected an integer >= 1"),
    ({"layers": ["nothing*"]}, r"layers\[0\]: 'nothing\*' matches no layer"),
    ({"layers": [""]}, "expected a non-empty list of module-path globs"),
    ({"target": "fp8"}, "asks no FP8"),
    ({"target": "bf16"}, "computes in float16, not bfloat16"),
    ({"target": "int8"}, "expected one of 'fp8', 'bf16', 'fp16'"),
    ({"hessian_samples": -1}, "hessian_samples=an integer -1"),
    ({"speed": "yes"}, "speed=a string 'yes': expected True \\(= .compiled.\\), .compiled. \\(whole training steps"),
])
def test_bad_arguments_name_the_argument_and_the_fix(kwargs, match):
    with pytest.raises(TuneError, match=match):
        unimp.sensitivity("mixed_fp16", planted(), BATCHES, loss_fn, **kwargs)


@pytest.mark.parametrize(("args", "match"), [
    (("mixed_fp16", [], loss_fn), "batches is empty"),
    (("mixed_fp16", "abc", loss_fn), "expected an iterable of batches"),
    (("mixed_fp16", BATCHES, None), "loss_fn=null: expected a callable"),
    (("mixed_fp16", BATCHES, lambda m, x: m(x)), r"loss_fn returned a ndarray for batches\[0\]"),
    (("fp32", BATCHES, loss_fn), "runs in float32: it lowers nothing"),
    (("mixed_fp16", BATCHES, lambda m, x: 0.0 * loss_fn(m, x)), "is 0 on every batch"),
    (("mixed_fp16", BATCHES, lambda m, x: math.nan * loss_fn(m, x)), r"is nan on batches\[0\] under the reference"),
    (("mixed_fp16", BATCHES, lambda m, x: 1.0), "loss_fn never ran the model it was given"),
])
def test_bad_inputs_are_refused_before_anything_runs_long(args, match):
    policy, batches, fn = args
    with pytest.raises(TuneError, match=match):
        unimp.sensitivity(policy, planted(), batches, fn)


def test_a_budget_must_be_a_relative_change():
    for value in (-0.1, math.inf, "1%", True):
        with pytest.raises(TuneError, match="max_loss_increase="):
            unimp.tune("mixed_fp16", planted(), BATCHES, loss_fn, max_loss_increase=value)


def test_measurements_the_backend_lacks():
    with pytest.raises(UnsupportedError, match="hessian_samples=2: backend numpy has no gradient hook"):
        unimp.sensitivity("mixed_fp16", planted(), BATCHES, loss_fn, hessian_samples=2)
    table = unimp.sensitivity("mixed_fp16", planted(), BATCHES, loss_fn)
    assert all(r.output_divergence is None and r.speedup is None for r in table.rows)  # not recorded: no column
    assert "output div." not in str(table)


SCRIPT = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
sys.path.insert(0, {str(Path(__file__).parent / "sixth_backend")!r})
import unimp
from unimp_numpy.backend import NumpyBackend
if "numpy" not in unimp.backends():
    unimp.register_backend(NumpyBackend)
from test_tune import BATCHES, loss_fn, planted

def make():
    return planted(), BATCHES, loss_fn

def broken():
    raise RuntimeError("no data today")

def two():
    return planted(), BATCHES
"""


def test_cli_writes_the_tuned_policy(write, tmp_path, capsys):
    script = write("factory.py", SCRIPT)
    out = tmp_path / "tuned.toml"
    assert main(["tune", f"{script}:make", "--policy", "mixed_fp16", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "most sensitive first" in printed.out and f"wrote {out}" in printed.err
    policy = unimp.load(out)
    assert policy.overrides[0].modules == ("big",) and policy.name == "mixed_fp16-tuned"
    assert main(["validate", str(out)]) == 0
    capsys.readouterr()
    assert main(["tune", f"{script}:make", "--policy", "mixed_fp16", "--max-loss-increase", "0.5"]) == 0
    assert unimp.load(tomllib.loads(capsys.readouterr().out)).overrides[0].modules == ("big",)  # to stdout


@pytest.mark.parametrize(("spec", "extra", "match"), [
    ("missing.py:make", [], "missing.py is not a .py file"),
    ("{script}:nothing", [], "defines no function 'nothing' (it defines: make, broken, two)"),
    ("{script}", [], "defines no function 'factory'"),
    ("{script}:broken", [], "the factory raised RuntimeError (traceback above)"),
    ("{script}:two", [], "returned a list of 2 items; it must return (model, batches, loss_fn)"),
    ("{script}:make", ["--max-layers", "1"], "more than max_layers=1"),
    ("{script}:make", ["--target", "fp8"], "asks no FP8"),
])
def test_cli_errors_are_one_located_message(write, capsys, spec, extra, match):
    script = write("factory.py", SCRIPT.replace("return planted(), BATCHES\n", "return [planted(), BATCHES]\n"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["tune", spec.format(script=script), "--policy", "mixed_fp16", *extra])
    err = capsys.readouterr().err
    assert code == 1 and match in err
    assert "Traceback" not in err or "no data today" in err  # only the user's own code's traceback


def test_kept_layers_share_an_override_when_the_policy_has_no_room_for_one_each():
    """A policy holds at most 256 overrides: with 254 of the user's, three kept layers go in one override listing
    them, a comment per module."""
    model = nn.Model([(f"big{i}", nn.Linear(np.full((8, 8), 1e5), np.zeros(8))) for i in range(3)])
    own = [{"modules": [f"elsewhere{i}"], "compute_dtype": "float32"} for i in range(254)]
    policy = unimp.load({"name": "crowded", "extends": "mixed_fp16", "overrides": own})
    tuned = unimp.tune(policy, model, BATCHES[:1], lambda m, x: float(m(x * 1e-5).astype(np.float32).mean()))
    assert tuned.policy.overrides[0].modules == ("big0", "big1", "big2") and len(tuned.policy.overrides) == 255
    lines = tuned.text.splitlines()
    at = lines.index("modules = [")
    assert [line.split(",")[0].strip() for line in lines[at + 1:at + 4]] == ['"big0"', '"big1"', '"big2"']
    assert all("# big" in line and "kept in float32" in line for line in lines[at + 1:at + 4])
    assert unimp.load(tomllib.loads(tuned.text)).fingerprint == tuned.policy.fingerprint
