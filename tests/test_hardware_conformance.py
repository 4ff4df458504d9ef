"""The conformance matrix records its hardware, and its regression check compares like with like."""

import json
import sys
from pathlib import Path

from imports import ROOT

from unimp import hardware

sys.path.insert(0, str(ROOT / "tools"))
from conformance_matrix import HARDWARE_KEY, hardware_lines, regressions

AVX2 = hardware.CpuFacts("x86_64", "test CPU", frozenset(hardware.LEVELS["avx2"])).record()
ZEN4 = hardware.CpuFacts("x86_64", "test CPU", frozenset(hardware.LEVELS["avx512_bf16"])).record()
BASELINE = {HARDWARE_KEY: ZEN4, "ipex:check_x[mixed_bf16]": "pass", "paddle:check_y[fp32]": "pass"}


def test_na_on_other_hardware_is_not_a_regression_but_a_failure_still_is():
    current = {"ipex:check_x[mixed_bf16]": "n/a", "paddle:check_y[fp32]": "fail"}
    assert regressions(BASELINE, current, AVX2) == ["regression: paddle:check_y[fp32] passed before, now fail"]


def test_na_on_the_baselines_own_hardware_is_a_regression():
    current = {"ipex:check_x[mixed_bf16]": "n/a", "paddle:check_y[fp32]": "pass"}
    assert regressions(BASELINE, current, ZEN4) == ["regression: ipex:check_x[mixed_bf16] passed before, now n/a"]


def test_matrix_names_the_cpu_of_each_observation():
    obs = {"torch": {"hardware": ZEN4}, "jax": {"hardware": ZEN4}}
    (line,) = hardware_lines(obs)
    assert "AVX512-BF16" in line and "avx512_bf16" in line
    assert len(hardware_lines({"torch": {"hardware": ZEN4}, "jax": {"hardware": AVX2}})) == 2


def test_the_committed_baseline_records_its_hardware():
    baseline = json.loads((Path(__file__).parents[1] / "docs" / "conformance.json").read_text())
    hw = baseline[HARDWARE_KEY]
    assert {"arch", "model", "features", "describe"} <= set(hw) and hw["features"]
