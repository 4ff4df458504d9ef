"""A real torch GradScaler configured from a real file (tests/fixtures/real_configs/torch: timm's
``torch.cuda.amp.GradScaler()`` line, executed as written) against the policy `unimp import` reads
from the same line: the same constructor values, then the same scales and skips on the system replay
sequences (the replay is test_loss_scale's: its ``_gradscaler`` driver and the core's reference)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from test_loss_scale import _gradscaler

from unimp.conformance.loss_scale import check_system_replay
from unimp.migrate.corpus import entries, imported, pasted

ROOT = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "real_configs"


def _entry(file: str, lines: list[int]) -> dict:
    (entry,) = [e for e in entries(ROOT, "torch") if e["file"] == file and e.get("lines") == lines]
    return entry


def test_timm_gradscaler_line_runs_the_imported_policy():
    entry = _entry("timm_utils_cuda.py.txt", [53, 53])
    spec = imported(ROOT, entry).policy.loss_scale
    # the line as timm wrote it; torch.cuda.amp.GradScaler is GradScaler("cuda", ...): the shim only
    # moves it to the CPU (no CUDA here), every argument is the file's
    cuda = SimpleNamespace(amp=SimpleNamespace(GradScaler=lambda *a, **k: torch.amp.GradScaler("cpu", *a, **k)))
    ns = {"torch": SimpleNamespace(cuda=cuda, amp=torch.amp), "self": SimpleNamespace()}
    exec(pasted(ROOT, entry), ns)
    real = ns["self"]._scaler
    fields = ("_init_scale", "_growth_factor", "_backoff_factor", "_growth_interval", "_enabled")
    driven = torch.amp.GradScaler("cpu", init_scale=spec.initial, growth_factor=spec.growth_factor,
                                  backoff_factor=spec.backoff_factor, growth_interval=spec.growth_interval)
    assert {f: getattr(real, f) for f in fields} == {f: getattr(driven, f) for f in fields}
    assert spec.mode == "dynamic" and spec.min == 0.0 and spec.max == float("inf")
    assert check_system_replay(_gradscaler, spec, n=8, max_len=400) == 8
