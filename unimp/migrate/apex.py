"""apex.amp: ``amp.initialize(model, optimizer, opt_level="O0".."O3", keep_batchnorm_fp32=...,
master_weights=..., loss_scale=..., min_loss_scale=..., max_loss_scale=...)``, both directions.

Read from apex/amp/frontend.py (the O0-O3 property sets) and apex/amp/scaler.py (LossScaler):
O0 float32, loss_scale 1.0; O1 patched torch functions (torch's CUDA autocast lists), dynamic
loss scale; O2 float16 model with batch norm kept float32 and float32 master weights, dynamic;
O3 pure float16 (batch norm too), no master weights, loss_scale 1.0. The dynamic LossScaler
starts at 2**16, grows x2 after 2000 clean steps clamped at max_loss_scale (2**24), halves on
overflow floored at min_loss_scale (None: no floor), and holds the scale as a Python float.
``cast_model_type`` and ``patch_torch_functions`` are what the opt_level sets; overriding them
is an error (pick the opt_level instead).

>>> imp = import_policy("O2", keep_batchnorm_fp32=False, loss_scale=128.0)
>>> imp.policy.ops.category("batch_norm"), imp.policy.loss_scale.mode
('lower', 'static')
>>> export_policy(imp.policy).config
{'opt_level': 'O2', 'keep_batchnorm_fp32': False, 'loss_scale': 128.0}
"""

from __future__ import annotations

from typing import Any

from ..loading import load
from ..policy import Policy
from .common import Draft, Exported, Imported, bad, check_keys, finish, flag, has_knob, kwargs_of, number, refuse

SYSTEM = "apex"
OVERRIDES = ("keep_batchnorm_fp32", "master_weights", "loss_scale", "min_loss_scale", "max_loss_scale",
             "cast_model_type", "patch_torch_functions")
LEVELS = {"O0": ("fp32", False, False, 1.0), "O1": ("apex_o1", None, False, "dynamic"),
          "O2": ("apex_o2", True, True, "dynamic"), "O3": ("apex_o2", False, False, 1.0)}


def import_policy(opt_level: str = "O1", *, source: str = "apex.amp.initialize", **overrides: Any) -> Imported:
    """The policy of ``amp.initialize(model, optimizer, opt_level=opt_level, **overrides)``."""
    check_keys(overrides, OVERRIDES, source)
    if opt_level not in LEVELS:
        raise bad(source, "opt_level", f"{opt_level!r} is not one of O0, O1, O2, O3 (letter O, not zero)")
    for key in ("cast_model_type", "patch_torch_functions"):
        if key in overrides:
            raise refuse(source, key, "an override of what the opt_level sets has no policy key",
                         "remove it and pick the opt_level that sets it (O1 patches functions, O2/O3 cast the model)")
    preset, keep_bn, masters, scale = LEVELS[opt_level]
    d = Draft(SYSTEM, source, preset, f"opt_level {opt_level}")
    if opt_level == "O3":
        d.set("param_dtype", "float16", "opt_level O3: pure float16 model")
    bn = overrides.get("keep_batchnorm_fp32", keep_bn)
    if "keep_batchnorm_fp32" in overrides:
        if opt_level in ("O0", "O1"):
            raise refuse(source, "keep_batchnorm_fp32", f"opt_level {opt_level} does not cast the model",
                         "remove it, or use O2/O3")
        bn = flag(source, "keep_batchnorm_fp32", overrides["keep_batchnorm_fp32"]) if not isinstance(
            overrides["keep_batchnorm_fp32"], str) else overrides["keep_batchnorm_fp32"] == "True"
    if opt_level in ("O2", "O3") and bn != (load(preset).ops.category("batch_norm") == "float32"):
        base = load(preset).ops
        lists = {"lower": [o for o in base.lower if o != "batch_norm"],
                 "float32": [o for o in base.float32 if o != "batch_norm"]}
        lists["float32" if bn else "lower"].append("batch_norm")
        where = "keep_batchnorm_fp32" if "keep_batchnorm_fp32" in overrides else f"opt_level {opt_level} default"
        d.set("ops.lower", lists["lower"], f"{preset} lists, batch_norm per {where}={bn}")
        d.set("ops.float32", lists["float32"], f"{preset} lists, batch_norm per {where}={bn}")
    if "master_weights" in overrides:
        d.set("master_weights.enabled", flag(source, "master_weights", overrides["master_weights"]), "master_weights")
    elif opt_level in ("O2", "O3"):
        d.set("master_weights.enabled", masters, f"master_weights not given: opt_level {opt_level} default")
    ls = overrides.get("loss_scale", scale)
    where = "loss_scale" if "loss_scale" in overrides else f"loss_scale not given: opt_level {opt_level} default"
    if ls == "dynamic":
        d.set("loss_scale.mode", "dynamic", where)
        d.set("loss_scale.initial", 65536.0, "LossScaler init 2**16")
        d.set("loss_scale.growth_interval", 2000, "LossScaler scale_window 2000")
        lo = overrides.get("min_loss_scale")
        d.set("loss_scale.min", 0.0 if lo is None else number(source, "min_loss_scale", lo, minimum=0),
              "min_loss_scale" if lo is not None else "min_loss_scale not given: None (no floor)")
        hi = overrides.get("max_loss_scale", 2.0 ** 24)
        d.set("loss_scale.max", number(source, "max_loss_scale", hi),
              "max_loss_scale" if "max_loss_scale" in overrides else "max_loss_scale not given: 2**24")
        d.set("loss_scale.on_max", "clamp", "LossScaler clamps at max_loss_scale")
        if has_knob("loss_scale.scale_dtype"):
            d.set("loss_scale.scale_dtype", "float64", "apex holds the scale as a Python float")
    else:
        value = number(source, "loss_scale", ls, minimum=0)
        d.set("loss_scale.mode", "static", where)
        d.set("loss_scale.initial", value, where)
        for key in ("min_loss_scale", "max_loss_scale"):
            if overrides.get(key) is not None:
                raise refuse(source, key, "only a dynamic loss scale has a floor or a cap",
                             "remove it, or use loss_scale='dynamic'")
    return d.build()


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, str) and "=" not in raw and "(" not in raw:
        return import_policy(raw.strip().strip("'\""), source=source)
    if isinstance(raw, str) and raw.strip()[:2] in LEVELS and raw.strip()[2:3] in (",", ";", " "):
        level, rest = raw.strip()[:2], raw.strip()[3:]
        raw = f"opt_level={level!r}, {rest}" if rest.strip() else f"opt_level={level!r}"
    kw = kwargs_of(raw, source, {"initialize": "initialize"}).get("initialize", {})
    return import_policy(kw.pop("opt_level", "O1"), source=source, **kw)


def export_policy(policy: Policy) -> Exported:
    """``amp.initialize`` keyword arguments for the policy."""
    c, p = policy.compute_dtype, policy.param_dtype
    if c == "float32":
        level = "O0"
    elif p == "float32":
        level = "O1"
    else:
        level = "O2" if policy.master_weights.enabled else "O3"
    cfg: dict[str, Any] = {"opt_level": level}
    default = import_policy(level).policy
    if level in ("O2", "O3"):
        bn = policy.ops.category("batch_norm") == "float32"
        if bn != (default.ops.category("batch_norm") == "float32"):
            cfg["keep_batchnorm_fp32"] = bn
    ls = policy.loss_scale
    if ls.mode == "dynamic":
        if default.loss_scale.mode != "dynamic":
            cfg["loss_scale"] = "dynamic"
        if ls.min > 0:
            cfg["min_loss_scale"] = ls.min
        if ls.max != 2.0 ** 24:
            cfg["max_loss_scale"] = ls.max
    elif ls.mode == "static" and (default.loss_scale.mode != "static" or default.loss_scale.initial != ls.initial):
        cfg["loss_scale"] = ls.initial
    args = ", ".join(f"{k}={v!r}" for k, v in cfg.items())
    text = f"model, optimizer = amp.initialize(model, optimizer, {args})\n"
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(**c))
