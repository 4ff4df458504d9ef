"""`unimp explain` prints the whole Plan contract, the resolved loss-scale rule included (every knob
the replay depends on: the dtype the scale is held in, subnormals, factor arithmetic)."""

from __future__ import annotations

import unimp
from unimp.plan import compile_ops


def _plan(policy, compute):
    p = unimp.load(policy)
    return compile_ops("demo", p, control={}, native={}, compute_dtype=compute)


def test_explain_shows_the_loss_scale_knobs():
    text = str(_plan("deepspeed_fp16", "float16"))
    ls = unimp.load("deepspeed_fp16").loss_scale
    line = next(x for x in text.splitlines() if x.startswith("loss scale: "))
    assert line.startswith(f"loss scale: dynamic from {ls.initial:g} ")
    for part in (f"held in {ls.scale_dtype}", f"subnormals {ls.subnormal}", f"factors in {ls.factor_arithmetic}",
                 f"hysteresis {ls.hysteresis}", f"at min: {ls.at_min}", f"after {ls.growth_interval} finite"):
        assert part in line, (part, line)
    assert "loss scale: none" in str(_plan("mixed_bf16", "bfloat16"))


def test_explain_says_when_auto_turned_loss_scaling_on():
    plan = _plan({"compute_dtype": "auto", "loss_scale": {"mode": "none"}}, "float16")
    assert plan.loss_scale.mode == "dynamic"
    assert "loss scale: dynamic from" in str(plan) and "auto resolved to float16 needs it" in str(plan)
