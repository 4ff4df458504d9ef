"""Paddle configured from real files (tests/fixtures/real_configs/paddle: PaddleClas configs' AMP
sections, handed to PaddleClas' own ppcls/utils/amp.py, executed verbatim, the way
ppcls/engine/engine.py ``Engine._init_amp`` hands them) against the policy `unimp import` reads from
the same file: the auto_cast level and the GradScaler's constructor values, then the GradScaler's
scales on the system replay sequences (test_loss_scale's ``_paddle_gradscaler`` driver and the core's
reference)."""

from __future__ import annotations

import inspect
from pathlib import Path

import paddle
import pytest
from test_loss_scale import _paddle_gradscaler

from unimp.conformance.loss_scale import check_system_replay
from unimp.migrate.corpus import entries, imported
from unimp.policy.loading import read_file

ROOT = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "real_configs"
CLAS = [e for e in entries(ROOT, "paddle") if "expect" in e and e["file"].endswith(".yaml")]


@pytest.mark.parametrize("entry", CLAS, ids=lambda e: e["file"])
def test_paddleclas_amp_section_runs_the_imported_policy(entry, monkeypatch):
    policy = imported(ROOT, entry).policy
    amp = read_file(ROOT / "paddle" / entry["file"])["AMP"]
    ns: dict = {}
    exec((ROOT / "paddle" / "PaddleClas_utils_amp.py.txt").read_text(), ns)
    made: list[dict] = []
    real = paddle.amp.GradScaler

    def recording(*args, **kwargs):
        made.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)

    monkeypatch.setattr(paddle.amp, "GradScaler", recording)
    # Engine._init_amp's arguments, read from the file as it reads them
    use_amp = bool(amp.get("use_amp", True))
    level = amp.get("level", "O1") if amp.get("level", "O1") in ("O1", "O2") else "O1"
    ns["build_scaler"](use_amp, scale_loss=amp.get("scale_loss", 1.0),
                       use_dynamic_loss_scaling=amp.get("use_dynamic_loss_scaling", False))
    cast = ns["AutoCast"](use_amp, amp_level=level, use_promote=amp.get("use_promote", False))
    spec = policy.loss_scale
    if not use_amp:
        assert made == [] and policy.compute_dtype == "float32" and spec.mode == "none"
        return
    assert cast.cast_context.keywords["level"] == level
    assert policy.param_dtype == ("float16" if level == "O2" else "float32")
    defaults = {k: p.default for k, p in inspect.signature(real).parameters.items()}
    got = {**defaults, **made[0]}
    assert (got["init_loss_scaling"], got["incr_ratio"], got["decr_ratio"], got["incr_every_n_steps"],
            got["decr_every_n_nan_or_inf"], got["use_dynamic_loss_scaling"]) == (
        spec.initial, spec.growth_factor, spec.backoff_factor, spec.growth_interval, spec.hysteresis,
        spec.mode == "dynamic")
    monkeypatch.undo()
    assert check_system_replay(_paddle_gradscaler, spec, n=4, max_len=200) == 4
