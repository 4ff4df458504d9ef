"""jmp: a policy string (``"params=float32,compute=float16,output=float32"``, ``"p=f32,c=f16"``,
``"half"``) + ``DynamicLossScale`` / ``StaticLossScale`` / ``NoOpLossScale``, both directions.

Read from jmp/_src/policy.py (``get_policy``: params default float32, compute follows params,
output follows compute; names full/f32/float32, f16/float16, bf16/bfloat16, half = float16 off
TPU) and jmp/_src/loss_scale.py (``DynamicLossScale(loss_scale, counter=0, period=2000,
factor=2, min_loss_scale=1)``: x factor on the period-th finite step kept only if finite,
max(min_loss_scale, scale / factor) on a non-finite step; float32 arithmetic; its pytree keeps
loss_scale, counter, period and factor only, so under ``jax.jit`` the floor is always 1).

>>> imp = import_policy("p=f32,c=f16,o=f32", {"loss_scale": 1024.0, "period": 10})
>>> imp.policy.compute_dtype, imp.policy.loss_scale.growth_interval
('float16', 10)
>>> export_policy(imp.policy).config["policy"]
'params=float32,compute=float16,output=float32'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.dtypes import f32
from unimp.migrate.draft import Draft, Exported, Imported, has_knob, take
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import calls
from unimp.migrate.values import bad, check_keys, number, refuse, text
from unimp.policy import Policy
from unimp.policy.spec import short

SYSTEM = "jmp"
NAMES = {"full": "float32", "f32": "float32", "float32": "float32", "f16": "float16", "float16": "float16",
         "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
DYNAMIC_KEYS = ("loss_scale", "counter", "period", "factor", "min_loss_scale")


def parse_policy(spec: str, source: str = "jmp") -> dict[str, str]:
    """``{"params", "compute", "output"}`` dtypes of a jmp policy string (``jmp.get_policy``'s grammar)."""
    def dtype(value: str, key: str) -> str:
        if value in ("f64", "float64"):
            raise refuse(source, key, "float64 is not a dtype unimp policies hold", "use float32")
        if value not in NAMES:
            raise bad(source, key, f"unknown dtype {short(value)} (full, half, float32, float16, bfloat16 or "
                                   f"f32/f16/bf16)")
        return NAMES[value]

    policy_text = text(source, "policy", spec).strip()
    if "=" not in policy_text:
        one = dtype(policy_text, "policy")
        return {"params": one, "compute": one, "output": one}
    got: dict[str, str] = {}
    for part in policy_text.split(","):
        key, _, value = part.partition("=")
        full = {"p": "params", "c": "compute", "o": "output"}.get(key.strip(), key.strip())
        if full not in ("params", "compute", "output"):
            raise bad(source, f"policy.{key.strip()}", "unknown key; expected params (p), compute (c), output (o)")
        if full in got:
            raise bad(source, f"policy.{full}", "given twice; keep one")
        got[full] = dtype(value.strip(), f"policy.{full}")
    params = got.get("params", "float32")
    compute = got.get("compute", params)
    return {"params": params, "compute": compute, "output": got.get("output", compute)}


def import_policy(policy: str = "params=float32,compute=float16,output=float32",
                  dynamic_loss_scale: Mapping[str, Any] | None = None, *, static_loss_scale: float | None = None,
                  no_op: bool = False, source: str = "jmp") -> Imported:
    """The policy of ``jmp.get_policy(policy)`` + a loss scale (``DynamicLossScale(**dynamic_loss_scale)``,
    ``StaticLossScale(static_loss_scale)`` or ``NoOpLossScale()`` with ``no_op``)."""
    dt = parse_policy(policy, source)
    d = Draft(SYSTEM, source, "jmp_float16", "jmp policy + DynamicLossScale rule")
    d.set("param_dtype", dt["params"], f"policy params={dt['params']}")
    d.set("compute_dtype", dt["compute"], f"policy compute={dt['compute']}")
    d.set("output_dtype", dt["output"], f"policy output={dt['output']}")
    if dt["params"] != "float32":
        d.set("master_weights.enabled", False, "jmp keeps no float32 copy of the params")
        d.set("distributed.reduce_dtype", dt["params"], f"gradients of {dt['params']} params are {dt['params']}")
    if no_op or (dynamic_loss_scale is None and static_loss_scale is None):
        d.set("loss_scale.mode", "none", "NoOpLossScale" if no_op else "no loss scale given")
        d.set("loss_scale.skip_nonfinite", False, "no loss scale: every step is taken")
        if not no_op and dt["compute"] == "float16":
            d.note("float16 compute without a loss scale: import the jmp.DynamicLossScale(...) line too if the "
                   "training step uses one", warn=True)
        return d.build()
    if static_loss_scale is not None:
        d.set("loss_scale.mode", "static", "StaticLossScale")
        d.set("loss_scale.initial", number(source, "StaticLossScale.loss_scale", static_loss_scale), "StaticLossScale")
        return d.build()
    kw = dict(dynamic_loss_scale or {})
    check_keys(kw, DYNAMIC_KEYS, source, "DynamicLossScale.")
    if "counter" in kw and number(source, "DynamicLossScale.counter", kw["counter"], int) != 0:
        raise refuse(source, "DynamicLossScale.counter", "a non-zero counter is training state, not configuration",
                     "import with counter=0 and resume it with amp.load_state_dict")
    p = "DynamicLossScale."
    d.set("loss_scale.mode", "dynamic", "DynamicLossScale")
    take(d, "loss_scale.initial", kw, "loss_scale", 32768.0, prefix=p)
    take(d, "loss_scale.growth_interval", kw, "period", 2000, kind=int, prefix=p)
    factor = take(d, "loss_scale.growth_factor", kw, "factor", 2.0, prefix=p)
    d.set("loss_scale.backoff_factor", f32(1.0 / f32(factor)) if factor > 1 else factor,
          f"{p}factor: adjust() writes loss_scale / factor; under jax.jit XLA makes it loss_scale * (1 / factor) "
          f"in float32 (its algebraic simplifier's HandleDivide), what a training step runs; an un-jitted "
          f"adjust() divides: loss_scale.backoff = 'divide' with backoff_factor = 1 / growth_factor")
    floor = number(source, f"{p}min_loss_scale", kw.get("min_loss_scale", 1.0))
    if floor != 1.0:
        d.note(f"{p}min_loss_scale = {floor!r} is lost when the loss scale passes through jax.jit or any "
               f"transformation (jmp's tree_unflatten rebuilds it with the default 1): imported as 1, what a jitted "
               f"training step runs; set loss_scale.min in this file to keep another floor", warn=True)
    d.set("loss_scale.min", 1.0, f"{p}min_loss_scale" + (" (1 inside jax.jit, see above)" if floor != 1.0 else
                                                         "" if "min_loss_scale" in kw else " not given: jmp default"))
    if has_knob("loss_scale.factor_arithmetic"):
        d.set("loss_scale.factor_arithmetic", "float32", "jmp multiplies in float32")
    return d.build()


CALLS = {"get_policy": "policy", "DynamicLossScale": "dynamic", "StaticLossScale": "static",
         "NoOpLossScale": "no_op"}
POSITIONAL = {"get_policy": ("policy",), "DynamicLossScale": DYNAMIC_KEYS, "StaticLossScale": ("loss_scale",),
              "NoOpLossScale": ()}


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, Mapping):
        check_keys(raw, ("policy", "DynamicLossScale", "StaticLossScale", "NoOpLossScale"), source)
        static = raw.get("StaticLossScale")
        if static is not None and not isinstance(static, Mapping):
            raise bad(source, "StaticLossScale", "expected a table {loss_scale = ...}")
        dyn = raw.get("DynamicLossScale")
        if dyn is not None and not isinstance(dyn, Mapping):
            raise bad(source, "DynamicLossScale", "expected a table of DynamicLossScale arguments")
        return import_policy(text(source, "policy", raw.get("policy", "float32")), dyn, source=source,
                             static_loss_scale=(static or {}).get("loss_scale"), no_op="NoOpLossScale" in raw)
    pol, dyn, static, no_op = None, None, None, False
    parts = [p.strip() for p in raw.replace("\n", ";").split(";") if p.strip()]
    code = "\n".join(p for p in parts if "(" in p)
    for p in parts:
        if "(" not in p:  # a bare policy string ("p=f32,c=f16")
            pol = p.strip("'\"")
    for c in calls(code, source, CALLS) if code else []:
        role = CALLS.get(c.last or "")
        if role is None:
            raise bad(source, c.name or "", f"unknown call {short(c.name)}; expected one of {', '.join(CALLS)} "
                                            f"(or a policy string)")
        names = POSITIONAL[c.last or ""]
        if len(c.args) > len(names):
            raise bad(source, c.name or "", f"{len(c.args)} positional arguments; {short(c.last)} takes {len(names)}")
        kw = {**dict(zip(names, c.args, strict=False)), **c.kwargs}
        if role == "policy":
            check_keys(kw, ("policy",), source, "get_policy.")
            pol = text(source, "get_policy.policy", kw.get("policy"))
        elif role == "dynamic":
            dyn = kw
        elif role == "static":
            check_keys(kw, ("loss_scale",), source, "StaticLossScale.")
            static = kw.get("loss_scale")
        else:
            no_op = True
    if pol is None:
        raise bad(source, "policy", "nothing read about the dtypes: no jmp.get_policy(...) or policy string; "
                                    "import the policy line too")
    return import_policy(pol, dyn, static_loss_scale=static, no_op=no_op, source=source)


def export_policy(policy: Policy) -> Exported:
    """``{"policy": "params=...,compute=...,output=...", "DynamicLossScale": {...}}``."""
    # jmp casts outputs to one dtype (Policy.cast_to_output); "unchanged" has none: the compute dtype, listed
    # as unexpressed (the re-import reads output=<compute> back)
    output = policy.output_cast or policy.compute_dtype
    name = f"params={policy.param_dtype},compute={policy.compute_dtype},output={output}"
    ls = policy.loss_scale
    cfg: dict[str, Any] = {"policy": name}
    if ls.mode == "dynamic":
        factor = int(ls.growth_factor) if ls.growth_factor.is_integer() else ls.growth_factor
        cfg["DynamicLossScale"] = {"loss_scale": ls.initial, "period": ls.growth_interval, "factor": factor,
                                   "min_loss_scale": ls.min}
        kw = cfg["DynamicLossScale"]
        scale = (f"jmp.DynamicLossScale(jnp.float32({kw['loss_scale']!r}), period={kw['period']}, "
                 f"factor={kw['factor']!r}, min_loss_scale=jnp.float32({kw['min_loss_scale']!r}))")
    elif ls.mode == "static":
        cfg["StaticLossScale"] = {"loss_scale": ls.initial}
        scale = f"jmp.StaticLossScale(jnp.float32({ls.initial!r}))"
    else:
        scale = "jmp.NoOpLossScale()"
    text = f"policy = jmp.get_policy({name!r})\nloss_scale = {scale}\n"
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(
        c["policy"], c.get("DynamicLossScale"), static_loss_scale=(c.get("StaticLossScale") or {}).get("loss_scale"),
        no_op="DynamicLossScale" not in c and "StaticLossScale" not in c))
