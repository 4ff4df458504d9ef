"""README "FP8 training": examples/fp8_keras.py runs, trains FP8 layers (report's fp8 column) and its loss falls."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import fp8_compare


def test_fp8_example_runs_and_reports_its_fp8_layers(capsys):
    fp8_compare.check("fp8_keras", ["--epochs", "12"], "delayed", lambda: capsys.readouterr().out)
