"""Keras 3 and tf.keras: a dtype policy + ``LossScaleOptimizer`` arguments, both directions.

Read as Keras reads them:

- policies: keras/src/dtype_policies/dtype_policy.py (``DTypePolicy``: "float32", "float16",
  "bfloat16" hold variables and compute in that dtype; "mixed_float16"/"mixed_bfloat16" float32
  variables, low compute; ``QuantizedFloat8DTypePolicy``: "float8_from_<policy>", amax history 1024;
  ``QuantizedDTypePolicy`` "int8_from_..."/"int4_from_..." quantize weights); tf.keras 2 (tf_keras)
  the same names without the quantized ones. Layers return outputs in the compute dtype; the
  losses are computed in float32 (``keras.losses.Loss.__call__`` casts to float32 in Keras 3).
- scaling: keras/src/optimizers/loss_scale_optimizer.py (``LossScaleOptimizer(inner_optimizer,
  initial_scale=2**15, dynamic_growth_steps=2000)``; ``Model.compile`` wraps the optimizer in one
  only for "mixed_float16") and tf_keras/src/mixed_precision/loss_scale_optimizer.py
  (``LossScaleOptimizer(inner_optimizer, dynamic=True, initial_scale=None -> 2**15,
  dynamic_growth_steps=None -> 2000)``; the TF 2.3 ``experimental.LossScaleOptimizer(optimizer,
  loss_scale)`` took "dynamic" or a number).
- forms: a policy name (+ ``; LossScaleOptimizer(...)``), code lines (``set_global_policy(...)``,
  ``keras.config.set_dtype_policy(...)``, ``mixed_precision.set_policy(...)``,
  ``policy = Policy(...)`` then ``set_global_policy(policy)``, ``LossScaleOptimizer(opt, ...)``),
  ``{"policy": ..., "LossScaleOptimizer": {...}}``, and TensorFlow Model Garden experiment files
  (``runtime.mixed_precision_dtype`` / ``runtime.loss_scale``: official/modeling/performance.py
  ``set_mixed_precision_policy`` and ``configure_optimizer``, official/core/base_task.py
  ``Task.create_optimizer``: the LossScaleOptimizer only when ``loss_scale`` is set and the dtype is
  "float16"; its training loop is orbit's, not ``compile``).

>>> imp = import_policy("mixed_float16", {"dynamic_growth_steps": 100})
>>> imp.policy.loss_scale.growth_interval, imp.policy.loss_scale.initial
(100, 32768.0)
>>> export_policy(imp.policy).config
{'policy': 'mixed_float16', 'LossScaleOptimizer': {'initial_scale': 32768.0, 'dynamic_growth_steps': 100}}
>>> from_cli("keras.mixed_precision.set_global_policy('mixed_bfloat16')", "x").policy.compute_dtype
'bfloat16'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.migrate.draft import Draft, Exported, Imported, take
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import calls, leading_name
from unimp.migrate.values import Name, bad, check_keys, number, refuse, text
from unimp.policy import Policy
from unimp.policy.loading import load
from unimp.policy.spec import short

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16")
POLICY_CALLS = ("set_global_policy", "set_policy", "set_dtype_policy", "Policy", "DTypePolicy", "FloatDTypePolicy")
LSO = "LossScaleOptimizer"
KERAS_INITIAL = 32768.0  # LossScaleOptimizer(initial_scale=2**15) in Keras 3 and tf.keras: where "auto" starts there
LSO_KEYS = {False: ("inner_optimizer", "initial_scale", "dynamic_growth_steps"),
            True: ("inner_optimizer", "dynamic", "initial_scale", "dynamic_growth_steps")}
TF_MODELS_RUNTIME = ("mixed_precision_dtype", "loss_scale")


def import_policy(policy: str = "float32", loss_scale_optimizer: Mapping[str, Any] | None = None, *,
                  tf_keras: bool = False, source: str | None = None, ignored: tuple[str, ...] = (),
                  why: str | None = None, lso_origin: str | None = None) -> Imported:
    """The policy of ``keras.mixed_precision.set_global_policy(policy)`` (+ ``LossScaleOptimizer(**args)``;
    ``None``: what ``compile`` does)."""
    system = "tf_keras" if tf_keras else "keras"
    source = source or system
    preset = "tf_keras_mixed_float16" if tf_keras else "keras_mixed_float16"
    text(source, "policy", policy)
    fp8 = False
    base = policy
    if policy.startswith(("int8_from_", "int4_from_")) and not tf_keras:
        raise refuse(source, "policy", f"{short(policy)} quantizes the weights to integers, which a unimp policy "
                     f"does not hold", f"import its source policy {short(policy.partition('_from_')[2])}")
    if policy.startswith("float8_from_") and not tf_keras:
        fp8, base = True, policy.removeprefix("float8_from_")
    if base not in POLICIES:
        raise bad(source, "policy", f"{short(policy)} is not one of {', '.join(POLICIES)}"
                  + ("" if tf_keras else " (or float8_from_<one of them>)"))
    lso = None if loss_scale_optimizer is None else dict(loss_scale_optimizer)
    if lso is not None:
        lso.pop("inner_optimizer", None)
        check_keys(lso, LSO_KEYS[tf_keras][1:], source, f"{LSO}.")
    where = why or f"policy {short(policy)}"
    if base == "float32" and not fp8:
        d = Draft(system, source, "fp32", f"{where}: full precision")
    else:
        d = Draft(system, source, "keras_float8" if fp8 else preset, f"{where}: Keras layer dtypes")
        low = "float32" if base == "float32" else "bfloat16" if base.endswith("bfloat16") else "float16"
        d.set("compute_dtype", low, where)
        if not base.startswith("mixed_") and base != "float32":
            d.set("param_dtype", low, f"{where}: variables in {low}")
            d.set("output_dtype", low, f"{where}: outputs in {low}")
            d.set("ops.float32", [], f"{where}: every layer computes in {low}")
            d.set("master_weights.enabled", False, f"{where}: no float32 copy")
            d.set("distributed.reduce_dtype", low, f"{where}: gradients of {low} variables are {low}")
        if fp8:
            d.set("fp8.amax_history", 1024, f"{where}: QuantizedFloat8DTypePolicy amax_history_length 1024")
    d.ignored.extend(ignored)
    scaled = lso is not None or (base == "mixed_float16" and why is None)
    if not scaled:
        d.set("loss_scale.mode", "none", "no LossScaleOptimizer")
        d.set("loss_scale.skip_nonfinite", False, "no LossScaleOptimizer: every step is taken")
        return d.build()
    lso = lso or {}
    given = lso_origin or (f"{LSO}." if loss_scale_optimizer is not None else f"compile() wraps {LSO}: ")
    dynamic = take(d, "loss_scale.mode", lso, "dynamic", True, kind=bool, prefix=given,
                   convert=lambda on: "dynamic" if on else "static")
    if dynamic == "static" and "initial_scale" not in lso:
        raise bad(source, f"{LSO}.initial_scale", "dynamic=False needs initial_scale (tf_keras raises "
                                                  "ValueError without it); write the fixed scale")
    if lso.get("initial_scale") is None:
        lso.pop("initial_scale", None)  # tf_keras: None means 2**15
    if lso.get("dynamic_growth_steps") is None:
        lso.pop("dynamic_growth_steps", None)  # tf_keras: None means 2000
    take(d, "loss_scale.initial", lso, "initial_scale", KERAS_INITIAL, prefix=given)
    if dynamic == "dynamic":
        take(d, "loss_scale.growth_interval", lso, "dynamic_growth_steps", 2000, kind=int, prefix=given)
        d.set("loss_scale.growth_factor", 2.0, f"{system} grows x2 (fixed)")
        d.set("loss_scale.backoff_factor", 0.5, f"{system} backs off /2 (fixed)")
        if base == "float32" or fp8:  # these extend presets without a scaler: the rule comes from Keras' preset
            for k, v in _rule(preset).items():
                d.set(f"loss_scale.{k}", v, f"{system} LossScaleOptimizer rule")
    return d.build()


def _rule(preset: str) -> dict[str, Any]:
    ls = load(preset).loss_scale
    return {k: getattr(ls, k) for k in ("min", "max", "growth_requires_finite", "on_max", "subnormal",
                                        "factor_arithmetic", "growth_schedule", "hysteresis", "scale_dtype")}


def _tf_models(raw: Mapping[str, Any], source: str) -> Imported:
    """A TensorFlow Model Garden experiment file (its ``runtime`` section), read as tf_keras."""
    runtime = raw["runtime"]
    if not isinstance(runtime, Mapping):
        raise bad(source, "runtime", "expected a table")
    dtype = runtime.get("mixed_precision_dtype")
    ignored = tuple([f"runtime.{k}" for k in runtime if k not in TF_MODELS_RUNTIME]
                    + [f"{k} (not the runtime)" for k in raw if k != "runtime"]
                    + [f"{k} (the input pipeline's dtype: the first layer casts to the compute dtype)"
                       for k in _dtype_keys(raw.get("task"), "task")])
    if dtype is None:
        raise bad(source, "runtime.mixed_precision_dtype", "nothing read: not set, so the Model Garden sets no "
                  "policy (float32); write mixed_precision_dtype: 'float32' to import that")
    names = {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16", "float32": "float32"}
    name = names.get(text(source, "runtime.mixed_precision_dtype", dtype))
    if name is None:
        raise bad(source, "runtime.mixed_precision_dtype", f"{short(dtype)} is not float16, bfloat16 or float32 "
                                                           f"(performance.set_mixed_precision_policy)")
    why = f"runtime.mixed_precision_dtype {short(dtype)}: set_global_policy({name!r})"
    scale = runtime.get("loss_scale")
    if not scale and dtype == "float16":  # base_task.create_optimizer: only `if runtime_config.loss_scale`
        return _unscaled(source, why, ignored)
    if not scale or dtype != "float16":
        return import_policy(name, None, tf_keras=True, source=source, why=why,
                             ignored=ignored + (("runtime.loss_scale (only read for float16)",) if scale else ()))
    if scale == "dynamic":
        lso: dict[str, Any] = {}
    else:
        lso = {"dynamic": False, "initial_scale": number(source, "runtime.loss_scale", scale, minimum=0)}
    return import_policy(name, lso, tf_keras=True, source=source, why=why, ignored=ignored,
                         lso_origin=f"runtime.loss_scale {short(scale)} -> configure_optimizer: {LSO}.")


def _dtype_keys(node: Any, where: str) -> list[str]:
    """``task.train_data.dtype``-style keys (input pipelines' dtypes) under ``node``."""
    out: list[str] = []
    stack = [(node, where)]
    while stack:
        n, w = stack.pop()
        if isinstance(n, Mapping):
            for k, v in n.items():
                if k == "dtype" and isinstance(v, str):
                    out.append(f"{w}.{k}")
                stack.append((v, f"{w}.{k}"))
    return sorted(out)


def _unscaled(source: str, why: str, ignored: tuple[str, ...]) -> Imported:
    """float16 without ``runtime.loss_scale``: the Model Garden builds no LossScaleOptimizer."""
    d = Draft("tf_keras", source, "tf_keras_mixed_float16", f"{why}: Keras layer dtypes")
    d.set("compute_dtype", "float16", why)
    d.set("loss_scale.mode", "none", "runtime.loss_scale not set: create_optimizer wraps no LossScaleOptimizer")
    d.set("loss_scale.skip_nonfinite", False, "no LossScaleOptimizer: every step is taken")
    d.note("float16 without runtime.loss_scale: the Model Garden trains without loss scaling", warn=True)
    d.ignored.extend(ignored)
    return d.build()


def from_cli(raw: Any, source: str, tf_keras: bool = False) -> Imported:
    if isinstance(raw, Mapping):
        if "runtime" in raw:
            return _tf_models(raw, source)
        check_keys(raw, ("policy", LSO), source)
        if "policy" not in raw:
            raise bad(source, "policy", "nothing read: no dtype policy given")
        given = raw.get(LSO)
        if given is not None and not isinstance(given, Mapping):
            raise bad(source, LSO, "expected a table of LossScaleOptimizer arguments")
        return import_policy(text(source, "policy", raw["policy"]), given, tf_keras=tf_keras, source=source)
    name, rest = leading_name(raw)
    if name is not None:
        lso_calls = _lso_of(rest, source, tf_keras) if rest.strip() else None
        return import_policy(name, lso_calls, tf_keras=tf_keras, source=source)
    policy: str | None = None
    lso: dict[str, Any] | None = None
    bound: dict[str, str] = {}
    for c in calls(raw, source, (*POLICY_CALLS, LSO)):
        if c.last in POLICY_CALLS:
            kw = {**dict(zip(("name",), c.args, strict=False)), **c.kwargs}
            check_keys(kw, ("name", "policy"), source, f"{c.last}.")
            value = kw.get("name", kw.get("policy"))
            if isinstance(value, Name):
                if value not in bound:
                    raise bad(source, f"{c.name}", f"{short(str(value))} is not a policy set above; pass the "
                                                   f"policy name")
                value = bound[value]
            value = text(source, f"{c.name}.name", value)
            if c.target is not None and c.last in ("Policy", "DTypePolicy", "FloatDTypePolicy"):
                bound[c.target] = value
            else:
                policy = value
            if c.last in ("Policy", "DTypePolicy", "FloatDTypePolicy") and c.target is None:
                policy = value
        elif c.last == LSO:
            lso = _lso_kwargs(c, source, tf_keras)
        else:
            raise bad(source, c.name or "", f"unknown call {short(c.name)}; expected set_global_policy(...), "
                      f"Policy(...) or LossScaleOptimizer(...)")
    if policy is None:
        if bound and len(set(bound.values())) == 1:
            policy = next(iter(bound.values()))
        else:
            raise bad(source, "policy", "nothing read: no set_global_policy(...) / Policy(...) given")
    return import_policy(policy, lso, tf_keras=tf_keras, source=source)


def _lso_of(text_: str, source: str, tf_keras: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for c in calls(text_, source, (LSO,)):
        if c.name is not None and c.last != LSO:
            raise bad(source, c.name, f"unknown call {short(c.name)}; expected {LSO}(...)")
        out.update(_lso_kwargs(c, source, tf_keras) if c.name else c.kwargs)
    return out


def _lso_kwargs(c: Any, source: str, tf_keras: bool) -> dict[str, Any]:
    """``LossScaleOptimizer(...)``'s arguments by its signature (the TF 2.3 experimental one too)."""
    if c.name and "experimental" in c.name:  # experimental.LossScaleOptimizer(optimizer, loss_scale)
        kw = {**dict(zip(("optimizer", "loss_scale"), c.args, strict=False)), **c.kwargs}
        check_keys(kw, ("optimizer", "loss_scale"), source, f"{LSO}.")
        scale = kw.get("loss_scale", "dynamic")
        if scale == "dynamic":
            return {}
        return {"dynamic": False, "initial_scale": number(source, f"{LSO}.loss_scale", scale, minimum=0)}
    names = LSO_KEYS[tf_keras]
    if len(c.args) > len(names):
        raise bad(source, c.name or LSO, f"{len(c.args)} positional arguments; {LSO} takes {len(names)}")
    kw = {**dict(zip(names, c.args, strict=False)), **c.kwargs}
    kw.pop("name", None)
    return kw


def export_policy(policy: Policy, tf_keras: bool = False) -> Exported:
    """``{"policy": name, "LossScaleOptimizer": {...}}`` for the policy."""
    c, p = policy.compute_dtype, policy.param_dtype
    name = "float32" if c == "float32" else (f"mixed_{c}" if p == "float32" else c)
    if policy.fp8.enabled and not tf_keras:
        name = f"float8_from_{name}"
    cfg: dict[str, Any] = {"policy": name}
    ls = policy.loss_scale.starting_at(KERAS_INITIAL, system := "tf_keras" if tf_keras else "keras")
    if ls.mode == "dynamic":
        cfg[LSO] = {"initial_scale": ls.initial, "dynamic_growth_steps": ls.growth_interval}
    elif ls.mode == "static" and tf_keras:
        cfg[LSO] = {"dynamic": False, "initial_scale": ls.initial}
    mod = "tf.keras" if tf_keras else "keras"
    text_ = f"{mod}.mixed_precision.set_global_policy({name!r})\n"
    if LSO in cfg:
        args = ", ".join(f"{k}={v!r}" for k, v in cfg[LSO].items())
        text_ += f"optimizer = {mod}.mixed_precision.LossScaleOptimizer(optimizer, {args})\n" if tf_keras else \
            f"optimizer = keras.optimizers.LossScaleOptimizer(optimizer, {args})\n"
    return finish(system, policy, cfg, text_,
                  lambda cf: import_policy(cf["policy"], cf.get(LSO), tf_keras=tf_keras), auto_initial=KERAS_INITIAL)
