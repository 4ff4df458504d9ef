"""Plug-in hygiene: lazy framework import, entry point, and the benchmark script's smoke mode."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import unimp

ROOT = Path(__file__).resolve().parents[3]


def test_entry_point_module_imports_no_framework():
    code = ("import sys, unimp_jax.backend, unimp; unimp.load('mixed_bf16'); "
            "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_backend_is_registered_and_explains():
    assert "jax" in unimp.backends()
    plan = unimp.get_backend("jax").compile(unimp.load("mixed_fp16"))
    assert plan.op("linear").control == "layer" and plan.op("elementwise").control == "fixed"


def test_bench_smoke(capsys):
    spec = importlib.util.spec_from_file_location("jax_bench", ROOT / "bench" / "jax_bench.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["jax_bench"] = bench  # dataclasses look their module up
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--no-fp32"]) == 0
    out = capsys.readouterr().out
    assert "unimp / native" in out and "blocks.0.fc1" in out
