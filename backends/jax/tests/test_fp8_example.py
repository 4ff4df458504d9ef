"""README "FP8 training": examples/fp8_jax.py runs, trains FP8 layers (report's fp8 column) and its loss falls."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "fp8_jax.py"


def test_fp8_example_runs_and_reports_its_fp8_layers(capsys):
    spec = importlib.util.spec_from_file_location("fp8_jax", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fp8, bf16 = mod.main(["--steps", "12"])
    out = capsys.readouterr().out
    recipe = "delayed" if "fp8_jax" == "fp8_keras" else "tensorwise"
    assert sum(line.split()[-1] == recipe for line in out.splitlines() if line.split()[1:2] == ["linear"]) >= 2
    assert fp8[-1] < fp8[0] and bf16[-1] < bf16[0]
