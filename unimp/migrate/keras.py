"""Keras 3 and tf.keras: a ``DTypePolicy`` name + ``LossScaleOptimizer`` arguments, both directions.

Read from keras/src/dtype_policies and keras/src/optimizers/loss_scale_optimizer.py (Keras 3:
``LossScaleOptimizer(inner, initial_scale=2**15, dynamic_growth_steps=2000)``, and ``compile``
wraps the optimizer in one only for "mixed_float16") and tf.keras 2's
``LossScaleOptimizer(inner, dynamic=True, initial_scale=2**15, dynamic_growth_steps=2000)``.
Policies: "float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16" (the whole layer).

>>> imp = import_policy("mixed_float16", {"dynamic_growth_steps": 100})
>>> imp.policy.loss_scale.growth_interval, imp.policy.loss_scale.initial
(100, 32768.0)
>>> export_policy(imp.policy).config
{'policy': 'mixed_float16', 'LossScaleOptimizer': {'initial_scale': 32768.0, 'dynamic_growth_steps': 100}}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..policy import Policy
from .common import Draft, Exported, Imported, bad, check_keys, finish, kwargs_of, leading_name, short, take

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")


def import_policy(policy: str = "float32", loss_scale_optimizer: Mapping[str, Any] | None = None, *,
                  tf_keras: bool = False, source: str | None = None) -> Imported:
    """The policy of ``keras.mixed_precision.set_dtype_policy(policy)`` (+ ``LossScaleOptimizer(**args)``)."""
    system = "tf_keras" if tf_keras else "keras"
    source = source or system
    preset = "tf_keras_mixed_float16" if tf_keras else "keras_mixed_float16"
    if policy not in POLICIES:
        tail = " (quantized layers are not a precision policy unimp holds)" if policy in (
            "int8", "float8", "int4") or str(policy).startswith(("int", "float8")) else ""
        raise bad(source, "policy", f"{short(policy)} is not one of {', '.join(POLICIES)}{tail}")
    lso = None if loss_scale_optimizer is None else dict(loss_scale_optimizer)
    keys = ("initial_scale", "dynamic_growth_steps") + (("dynamic",) if tf_keras else ())
    if lso is not None:
        check_keys(lso, keys, source, "LossScaleOptimizer.")
    where = f"policy {policy!r}"
    if policy == "float32":
        d = Draft(system, source, "fp32", f"{where}: full precision")
    else:
        d = Draft(system, source, preset, f"{where}: Keras layer dtypes")
        low = "bfloat16" if policy.endswith("bfloat16") else "float16"
        d.set("compute_dtype", low, where)
        if not policy.startswith("mixed_"):
            d.set("param_dtype", low, f"{where}: variables in {low}")
            d.set("output_dtype", low, f"{where}: outputs in {low}")
            d.set("ops.float32", [], f"{where}: every layer computes in {low}")
            d.set("master_weights.enabled", False, f"{where}: no float32 copy")
    scaled = lso is not None or policy == "mixed_float16"
    if not scaled:
        d.set("loss_scale.mode", "none", "no LossScaleOptimizer")
        d.set("loss_scale.skip_nonfinite", False, "no LossScaleOptimizer: every step is taken")
        return d.build()
    lso = lso or {}
    given = "LossScaleOptimizer." if loss_scale_optimizer is not None else "compile() wraps LossScaleOptimizer: "
    dynamic = take(d, "loss_scale.mode", lso, "dynamic", True, kind=bool, prefix=given,
                   convert=lambda on: "dynamic" if on else "static")
    take(d, "loss_scale.initial", lso, "initial_scale", 32768.0, prefix=given)
    if dynamic == "dynamic":
        take(d, "loss_scale.growth_interval", lso, "dynamic_growth_steps", 2000, kind=int, prefix=given)
        d.set("loss_scale.growth_factor", 2.0, f"{system} grows x2 (fixed)")
        d.set("loss_scale.backoff_factor", 0.5, f"{system} backs off /2 (fixed)")
        if policy == "float32":  # the rule comes from the preset, not from fp32
            for k, v in _rule(preset).items():
                d.set(f"loss_scale.{k}", v, f"{system} LossScaleOptimizer rule")
    return d.build()


def _rule(preset: str) -> dict[str, Any]:
    from ..loading import load

    ls = load(preset).loss_scale
    return {"min": ls.min, "max": ls.max, "growth_requires_finite": ls.growth_requires_finite}


def from_cli(raw: Any, source: str, tf_keras: bool = False) -> Imported:
    name, raw = leading_name(raw)
    if name is not None:
        lso = kwargs_of(raw, source, {"LossScaleOptimizer": "lso"}).get("lso") if raw.strip() else None
        return import_policy(name, lso, tf_keras=tf_keras, source=source)
    if isinstance(raw, Mapping) and isinstance(raw.get("policy"), str):  # what export_policy writes
        check_keys(raw, ("policy", "LossScaleOptimizer"), source)
        return import_policy(raw["policy"], raw.get("LossScaleOptimizer"), tf_keras=tf_keras, source=source)
    kw = kwargs_of(raw, source, {"DTypePolicy": "policy", "Policy": "policy", "set_dtype_policy": "policy",
                                 "LossScaleOptimizer": "lso"})
    pol = kw.get("policy", {})
    check_keys(pol, ("name", "policy"), source)
    return import_policy(pol.get("name", pol.get("policy", "float32")), kw.get("lso"), tf_keras=tf_keras,
                         source=source)


def export_policy(policy: Policy, tf_keras: bool = False) -> Exported:
    """``{"policy": name, "LossScaleOptimizer": {...}}`` for the policy."""
    c, p = policy.compute_dtype, policy.param_dtype
    name = "float32" if c == "float32" else (f"mixed_{c}" if p == "float32" else c)
    cfg: dict[str, Any] = {"policy": name}
    ls = policy.loss_scale
    if ls.mode == "dynamic":
        cfg["LossScaleOptimizer"] = {"initial_scale": ls.initial, "dynamic_growth_steps": ls.growth_interval}
    elif ls.mode == "static" and tf_keras:
        cfg["LossScaleOptimizer"] = {"dynamic": False, "initial_scale": ls.initial}
    system = "tf_keras" if tf_keras else "keras"
    mod = "tf.keras" if tf_keras else "keras"
    text = f"{mod}.mixed_precision.set_global_policy({name!r})\n"
    if "LossScaleOptimizer" in cfg:
        args = ", ".join(f"{k}={v!r}" for k, v in cfg["LossScaleOptimizer"].items())
        text += f"optimizer = {mod}.mixed_precision.LossScaleOptimizer(optimizer, {args})\n" if tf_keras else \
            f"optimizer = keras.optimizers.LossScaleOptimizer(optimizer, {args})\n"
    return finish(system, policy, cfg, text,
                  lambda cf: import_policy(cf["policy"], cf.get("LossScaleOptimizer"), tf_keras=tf_keras))
