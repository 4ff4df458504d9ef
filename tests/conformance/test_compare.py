"""The comparison itself: disagreements are found and named (backend, policy, layer/step, values)."""

import copy
import json
import os
import sys
from pathlib import Path

import pytest
from imports import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from conformance_matrix import compare_dtypes, compare_losses, compare_trajectories, regressions

OBS = Path(os.environ.get("OBS_DIR", ".obs"))


def observations():
    found = {p.stem: json.loads(p.read_text()) for p in sorted(OBS.glob("*.json")) if "-" not in p.stem}
    if not found:
        pytest.skip(f"no backend observations in {OBS} (the backend tox envs write them)")
    return found


def test_a_backend_that_lowers_log_softmax_is_named():
    obs = observations()
    controlling = {n: o for n, o in obs.items() if isinstance(o["dtypes"].get("mixed_bf16"), dict)
                   and o["dtypes"]["mixed_bf16"].get("honoured", {}).get("log_softmax")
                   and o["dtypes"]["mixed_bf16"]["control"].get("log_softmax") != "fixed"}
    if not controlling:
        pytest.skip("no observed backend controls log_softmax")
    name, good = next(iter(controlling.items()))
    bad = copy.deepcopy(good)
    bad["dtypes"]["mixed_bf16"]["layers"]["logp"][0] = "bfloat16"
    problems = compare_dtypes({name: good, "broken": bad})
    assert any("layer logp" in p and "broken observed ['bfloat16'" in p and "core expects ['float32'" in p
               for p in problems), problems


def test_a_backend_that_casts_an_unchanged_output_is_named():
    """custom_moved_ops (output_dtype "unchanged", log_softmax lowered): the output is the last layer's bf16;
    a backend that casts it to float32 anyway is named."""
    obs = {n: o for n, o in observations().items() if isinstance(o["dtypes"].get("custom_moved_ops"), dict)
           and o["dtypes"]["custom_moved_ops"].get("output") == "bfloat16"}
    if not obs:
        pytest.skip("no observed backend ran custom_moved_ops in bfloat16 (observations from before 'output')")
    name, good = next(iter(obs.items()))
    bad = copy.deepcopy(good)
    bad["dtypes"]["custom_moved_ops"]["output"] = "float32"
    problems = compare_dtypes({name: good, "broken": bad})
    assert any("model output" in p and "broken observed float32" in p and "core expects bfloat16" in p
               for p in problems), problems


def test_a_scaler_that_grows_one_step_late_is_named():
    obs = observations()
    name, good = next(iter(obs.items()))
    bad = copy.deepcopy(good)
    t = bad["trajectories"]["torch_rule"]
    first_growth = next(i for i in range(1, len(t["scales"])) if t["scales"][i] > t["scales"][i - 1])
    t["scales"][first_growth] = t["scales"][first_growth - 1]
    problems = compare_trajectories({"broken": bad})
    assert any(p.startswith(f"trajectory: broken, torch_rule, step {first_growth}: expected") for p in problems)
    assert compare_trajectories({name: good}) == []


def test_losses_that_drift_are_named():
    obs = observations()
    name, good = next(iter(obs.items()))
    bad = copy.deepcopy(good)
    bad["losses"]["fp32"][3] += 0.5
    problems = compare_losses({name: good, "broken": bad})
    assert any("policy fp32, step 3" in p for p in problems), problems


def test_regressions_against_the_baseline():
    assert regressions({"torch:check_x[fp32]": "pass"}, {"torch:check_x[fp32]": "fail"}) == [
        "regression: torch:check_x[fp32] passed before, now fail"]
    assert regressions({"torch:check_x[fp32]": "pass"}, {}) == [
        "regression: torch:check_x[fp32] passed before, now missing"]
