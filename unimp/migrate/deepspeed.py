"""DeepSpeed: the ``fp16`` / ``bf16`` / ``zero_optimization`` / ``communication_data_type`` sections
of a DeepSpeed JSON config, both directions.

Defaults read from deepspeed/runtime/fp16/loss_scaler.py and the config constants: loss_scale 0
(dynamic), initial_scale_power 16, loss_scale_window 1000, hysteresis 2, consecutive_hysteresis
false, min_loss_scale 1. Without ZeRO the engine builds ``FP16_Optimizer`` (fused_optimizer.py),
whose ``_update_scale`` has no hysteresis and clamps at min_loss_scale; with ZeRO (stage 1-3)
the ``DynamicLossScaler`` counts hysteresis (refilled on growth, or on every clean step with
consecutive_hysteresis) and raises when a backoff is needed at the minimum. Other top-level keys
(batch sizes, optimizer, scheduler, ...) are not precision settings: they are ignored and listed
in the file's header. Unknown keys inside ``fp16`` / ``bf16`` are errors.

>>> imp = import_policy({"fp16": {"enabled": True, "loss_scale_window": 500}, "zero_optimization": {"stage": 2}})
>>> imp.policy.loss_scale.growth_interval, imp.policy.loss_scale.hysteresis
(500, 2)
>>> import_policy({"fp16": {"enabled": True}}).policy.loss_scale.hysteresis
1
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..loading import preset_names
from ..policy import Policy
from ..spec import show
from .common import (
    Draft,
    Exported,
    Imported,
    bad,
    check_keys,
    finish,
    flag,
    has_knob,
    number,
    power_of_two,
    refuse,
    take,
)

SYSTEM = "deepspeed"
FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads")
PRECISION = ("fp16", "bf16", "bfloat16", "zero_optimization", "communication_data_type", "amp", "torch_autocast")
DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16", "bf16": "bfloat16",
          "bfloat16": "bfloat16"}


def _zero_preset() -> str:
    return "deepspeed_zero_fp16" if "deepspeed_zero_fp16" in preset_names() else "deepspeed_fp16"


def import_policy(config: Mapping[str, Any], *, source: str = "deepspeed config") -> Imported:
    """The policy a DeepSpeed engine built from ``config`` trains with."""
    if not isinstance(config, Mapping):
        raise bad(source, "", "expected a JSON object (the DeepSpeed config)")
    fp16 = _section(config, "fp16", source)
    bf16 = _section(config, "bf16", source) or _section(config, "bfloat16", source)
    check_keys(fp16, FP16_KEYS, source, "fp16.")
    check_keys(bf16, BF16_KEYS, source, "bf16.")
    for key in ("amp", "torch_autocast"):
        sec = _section(config, key, source)
        if sec.get("enabled"):
            fix = ("import the apex opt_level with `unimp import O1 --from apex`" if key == "amp"
                   else "use fp16 or bf16 sections instead")
            raise refuse(source, f"{key}.enabled", f"DeepSpeed's {key!r} mode is not imported", fix)
    stage = _stage(config, source)
    fp16_on = flag(source, "fp16.enabled", fp16.get("enabled", False))
    bf16_on = flag(source, "bf16.enabled", bf16.get("enabled", False))
    if fp16_on and bf16_on:
        raise bad(source, "fp16.enabled", "fp16 and bf16 are both enabled (DeepSpeed refuses this); enable one")
    for sec, key in (("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads")):
        if (fp16 if sec == "fp16" else bf16).get(key):
            raise refuse(source, f"{sec}.{key}", "master weights in the low dtype are not expressible (unimp keeps "
                         "float32 masters)", f"remove {key}")
    if fp16.get("auto_cast"):
        raise refuse(source, "fp16.auto_cast", "casting the model's inputs is not a policy key",
                     "remove it: unimp casts the inputs of each op to the policy's dtype")
    if fp16_on:
        d = _fp16(fp16, stage, source)
    elif bf16_on:
        d = Draft(SYSTEM, source, "pure_bf16", "bf16.enabled: bf16 params, fp32 master weights in the optimizer")
        d.set("compute_dtype", "bfloat16", "bf16.enabled")
        d.set("param_dtype", "bfloat16", "bf16.enabled")
        d.set("master_weights.enabled", True, "bf16.enabled: fp32 masters")
        check = flag(source, "bf16.check_grad_overflow", bf16.get("check_grad_overflow", False))
        d.set("loss_scale.skip_nonfinite", check, "bf16.check_grad_overflow" if "check_grad_overflow" in bf16 else
              "bf16.check_grad_overflow not given: false (every step is taken)")
    else:
        d = Draft(SYSTEM, source, "fp32", "neither fp16 nor bf16 enabled: full precision")
    if "communication_data_type" in config and config["communication_data_type"] is not None:
        v = config["communication_data_type"]
        if not isinstance(v, str) or v not in DTYPES:  # a list or table is not a dtype name (unhashable)
            raise bad(source, "communication_data_type", f"{show(v)} is not one of {', '.join(DTYPES)}")
        d.set("distributed.reduce_dtype", DTYPES[v], "communication_data_type")
    d.ignored.extend(k for k in config if k not in PRECISION)
    return d.build()


def _section(config: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    sec = config.get(key) or {}
    if not isinstance(sec, Mapping):
        raise bad(source, key, "expected a JSON object")
    return sec


def _stage(config: Mapping[str, Any], source: str) -> int:
    zero = config.get("zero_optimization", {})
    if isinstance(zero, bool):
        return int(zero)
    if not isinstance(zero, Mapping):
        raise bad(source, "zero_optimization", "expected a JSON object")
    stage = number(source, "zero_optimization.stage", zero.get("stage", 0), int, minimum=0)
    if stage > 3:
        raise bad(source, "zero_optimization.stage", f"{stage}: ZeRO stages are 0-3")
    return stage


def _fp16(fp16: Mapping[str, Any], stage: int, source: str) -> Draft:
    p = "fp16."
    zero = stage > 0
    if zero:
        d = Draft(SYSTEM, source, _zero_preset(), f"fp16 with ZeRO stage {stage}: DynamicLossScaler")
    else:
        d = Draft(SYSTEM, source, "deepspeed_fp16", "fp16 without ZeRO: FP16_Optimizer")
    static = number(source, "fp16.loss_scale", fp16.get("loss_scale", 0), minimum=0)
    if static > 0:
        d.set("loss_scale.mode", "static", "fp16.loss_scale > 0: static scale")
        d.set("loss_scale.initial", static, "fp16.loss_scale")
        return d
    d.set("loss_scale.mode", "dynamic", "fp16.loss_scale = 0" if "loss_scale" in fp16 else
          "fp16.loss_scale not given: 0 (dynamic)")
    take(d, "loss_scale.initial", fp16, "initial_scale_power", 16, kind=int, prefix=p, minimum=-126,
         convert=lambda k: 2.0 ** k)
    take(d, "loss_scale.growth_interval", fp16, "loss_scale_window", 1000, kind=int, prefix=p)
    take(d, "loss_scale.min", fp16, "min_loss_scale", 1.0, prefix=p)
    d.set("loss_scale.growth_factor", 2.0, "DeepSpeed scale_factor 2 (fixed)")
    d.set("loss_scale.backoff_factor", 0.5, "DeepSpeed scale_factor 2 (fixed)")
    d.set("loss_scale.max", float("inf"), "DeepSpeed has no cap")
    if zero:
        take(d, "loss_scale.hysteresis", fp16, "hysteresis", 2, kind=int, prefix=p, minimum=1)
        take(d, "loss_scale.hysteresis_refill", fp16, "consecutive_hysteresis", False, kind=bool, prefix=p,
             convert=lambda c: ["finite", "growth"] if c else ["growth"])
        d.set("loss_scale.at_min", "error", "DynamicLossScaler raises at the minimum")
    else:
        for key in ("hysteresis", "consecutive_hysteresis"):
            if key in fp16:
                d.note(f"fp16.{key} = {fp16[key]!r} is ignored by DeepSpeed without ZeRO (FP16_Optimizer has no "
                       f"hysteresis); set zero_optimization.stage >= 1 to use it", warn=True)
        d.set("loss_scale.hysteresis", 1, "FP16_Optimizer has no hysteresis")
        d.set("loss_scale.at_min", "clamp", "FP16_Optimizer stays at min_loss_scale")
    if has_knob("loss_scale.scale_dtype"):
        d.set("loss_scale.scale_dtype", "float64", "DeepSpeed holds the scale as a Python float")
    return d


def export_policy(policy: Policy) -> Exported:
    """A DeepSpeed config (``fp16``/``bf16``, ``zero_optimization.stage``, ``communication_data_type``)."""
    cfg: dict[str, Any] = {}
    ls = policy.loss_scale
    if policy.compute_dtype == "float16":
        sec: dict[str, Any] = {"enabled": True}
        if ls.mode == "static":
            sec["loss_scale"] = ls.initial
        elif ls.mode == "dynamic":
            power = power_of_two(ls.initial)
            sec.update(loss_scale=0, initial_scale_power=power if power is not None else 16,
                       loss_scale_window=ls.growth_interval, min_loss_scale=ls.min)
            zero = ls.hysteresis > 1 or ls.at_min == "error"
            if zero:
                sec.update(hysteresis=ls.hysteresis, consecutive_hysteresis="finite" in ls.hysteresis_refill)
            cfg["zero_optimization"] = {"stage": 1 if zero else 0}
        cfg = {"fp16": sec, **cfg}
    elif policy.compute_dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True, **({"check_grad_overflow": True} if ls.skip_nonfinite else {})}
    if policy.distributed.reduce_dtype != "float32":
        cfg["communication_data_type"] = {"float16": "fp16", "bfloat16": "bf16"}[policy.distributed.reduce_dtype]
    return finish(SYSTEM, policy, cfg, json.dumps(cfg, indent=2) + "\n", import_policy)


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise bad(source, "", f"not a DeepSpeed JSON config ({e})") from None
    return import_policy(raw, source=source)
