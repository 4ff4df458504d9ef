"""apex.amp: ``amp.initialize(model, optimizer, opt_level="O0".."O3", keep_batchnorm_fp32=...,
master_weights=..., loss_scale=..., min_loss_scale=..., max_loss_scale=...)``, both directions.

Read from NVIDIA/apex e13873debc4699d39c6861074b9a3b2a02327f92 (the last commit with apex.amp):
apex/amp/frontend.py (the O0-O3 property sets, ``Properties.__setattr__``, ``initialize``) and
apex/amp/scaler.py (LossScaler): O0 float32, loss_scale 1.0; O1 patched torch functions (torch's
CUDA autocast lists), dynamic loss scale; O2 float16 model with batch norm kept float32 and
float32 master weights, dynamic ("O2 does not patch Torch functions": every op runs in the model's
fp16); O3 "pure FP16 training" (batch norm too), no master weights, loss_scale 1.0. O2/O3 outputs
are cast to float32 (_initialize.py patch_forward) unless ``cast_model_outputs``. An override given
as None keeps the opt_level's value (frontend.py initialize: "additional kwargs that are not None").
The dynamic LossScaler starts at 2**16, grows x2 after 2000 clean steps clamped at max_loss_scale (2**24), halves on
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

from unimp.migrate.draft import Draft, Exported, Imported, has_knob
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import kwargs_of
from unimp.migrate.values import bad, check_keys, flag, number, refuse
from unimp.policy import Policy
from unimp.policy.loading import load
from unimp.policy.spec import short

SYSTEM = "apex"
OVERRIDES = ("keep_batchnorm_fp32", "master_weights", "loss_scale", "min_loss_scale", "max_loss_scale",
             "cast_model_type", "patch_torch_functions", "enabled", "verbosity", "num_losses", "cast_model_outputs")
LEVELS = {"O0": ("fp32", False, False, 1.0), "O1": ("apex_o1", None, False, "dynamic"),
          "O2": ("apex_o2", True, True, "dynamic"), "O3": ("apex_o2", False, False, 1.0)}
TORCH_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32",
                "float": "float32"}


def _val(v: Any) -> str:
    """A source value for a note: numbers and booleans as written, anything else quoted and bounded."""
    return repr(v) if isinstance(v, bool | int | float) else short(v)


def import_policy(opt_level: str = "O1", *, source: str = "apex.amp.initialize", **overrides: Any) -> Imported:
    """The policy of ``amp.initialize(model, optimizer, opt_level=opt_level, **overrides)``."""
    check_keys(overrides, OVERRIDES, source)
    if not isinstance(opt_level, str) or opt_level not in LEVELS:
        raise bad(source, "opt_level", f"{short(opt_level)} is not one of O0, O1, O2, O3 (letter O, not zero)")
    overrides = {k: v for k, v in overrides.items() if v is not None}  # None: the opt_level's value
    notes = []
    for key, why in (("verbosity", "how much amp prints"), ("num_losses", "how many losses get a LossScaler of "
                                                                         "this rule (one each)")):
        if key in overrides:
            notes.append(f"{key} = {_val(overrides.pop(key))}: {why}, not a precision setting (ignored)")
    if "enabled" in overrides and not flag(source, "enabled", overrides.pop("enabled")):
        d = Draft(SYSTEM, source, "fp32", "enabled=False: amp.initialize returns the model and optimizer unchanged")
        d.set("loss_scale.mode", "none", "enabled=False: no loss scaling")
        d.notes += notes
        return d.build()
    if "cast_model_type" in overrides:
        want = {"O0": "float32", "O2": "float16", "O3": "float16"}.get(opt_level)
        got = TORCH_DTYPES.get(str(overrides["cast_model_type"]).removeprefix("torch."))
        if got is None or got != want:
            raise refuse(source, "cast_model_type", f"{short(overrides['cast_model_type'])} differs "
                         f"from what opt_level "
                         f"{opt_level} sets ({want or 'no cast'}); a model cast apex does not test has no preset here",
                         "remove it and pick the opt_level that casts the model as you want (O2/O3: fp16)")
        notes.append(f"cast_model_type = {_val(overrides.pop('cast_model_type'))}: what opt_level {opt_level} sets")
    if "patch_torch_functions" in overrides:
        if bool(overrides["patch_torch_functions"]) != (opt_level == "O1"):
            raise refuse(source, "patch_torch_functions", "an override of what the opt_level sets has no policy key",
                         "remove it and pick the opt_level that sets it (O1 patches functions, O2/O3 cast the model)")
        notes.append(f"patch_torch_functions = {_val(overrides.pop('patch_torch_functions'))}: what opt_level "
                     f"{opt_level} sets")
    outputs = overrides.pop("cast_model_outputs", None)
    preset, keep_bn, masters, scale = LEVELS[opt_level]
    d = Draft(SYSTEM, source, preset, f"opt_level {opt_level}")
    d.notes += notes
    if opt_level == "O3":
        d.set("param_dtype", "float16", "opt_level O3: pure float16 model (frontend.py O3: .half() on the model)")
    if outputs is not None:
        if opt_level not in ("O2", "O3") or TORCH_DTYPES.get(str(outputs).removeprefix("torch.")) is None:
            raise refuse(source, "cast_model_outputs", f"{short(outputs)}: apex casts outputs only "
                         "with O2/O3 (the model "
                         "cast), to a torch dtype", "remove it, or use O2/O3 with torch.float16/torch.float32")
        d.set("output_dtype", TORCH_DTYPES[str(outputs).removeprefix("torch.")], "cast_model_outputs")
    bn = overrides.get("keep_batchnorm_fp32", keep_bn)
    if "keep_batchnorm_fp32" in overrides:
        if opt_level in ("O0", "O1"):
            raise refuse(source, "keep_batchnorm_fp32", f"opt_level {opt_level} does not cast the model "
                         "(frontend.py: 'keep_batchnorm_fp32 should be None')", "remove it, or use O2/O3")
        raw = overrides["keep_batchnorm_fp32"]
        if raw not in (True, False, "True", "False"):
            raise bad(source, "keep_batchnorm_fp32", f"{short(raw)}: apex takes a boolean, "
                                                     "the string 'True' or 'False', "
                                                     "or None (frontend.py Properties.__setattr__)")
        bn = raw in (True, "True")
    if opt_level in ("O2", "O3") and bn != (load(preset).ops.category("batch_norm") == "float32"):
        base = load(preset).ops
        lists = {"lower": [o for o in base.lower if o != "batch_norm"],
                 "float32": [o for o in base.float32 if o != "batch_norm"]}
        lists["float32" if bn else "lower"].append("batch_norm")
        where = "keep_batchnorm_fp32" if "keep_batchnorm_fp32" in overrides else f"opt_level {opt_level} default"
        d.set("ops.lower", lists["lower"], f"{preset} lists, batch_norm per {where}={bn}")
        d.set("ops.float32", lists["float32"], f"{preset} lists, batch_norm per {where}={bn}")
    if "master_weights" in overrides and opt_level == "O1":
        raise refuse(source, "master_weights", "O1 keeps the model's float32 weights (frontend.py: 'It doesn't make "
                     "sense to use master_weights with O1')", "remove it, or use O2")
    if "master_weights" in overrides:
        d.set("master_weights.enabled", flag(source, "master_weights", overrides["master_weights"]), "master_weights")
    elif opt_level in ("O2", "O3"):
        d.set("master_weights.enabled", masters, f"master_weights not given: opt_level {opt_level} default")
    ls = overrides.get("loss_scale", scale)
    if isinstance(ls, str) and ls != "dynamic":  # Properties.__setattr__: float(value) unless "dynamic"
        try:
            ls = float(ls)
        except ValueError:
            raise bad(source, "loss_scale", f"{short(ls)} is neither 'dynamic' nor a number") from None
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
        if value == 1.0:
            d.set("loss_scale.mode", "none", f"{where}: 1.0, the loss is multiplied by 1 (no loss scaling)")
        else:
            d.set("loss_scale.mode", "static", where)
            d.set("loss_scale.initial", value, where)
        d.set("loss_scale.skip_nonfinite", False, "a static LossScaler never skips a step (scaler.py update_scale: "
              "should_skip only when dynamic)")
        for key in ("min_loss_scale", "max_loss_scale"):
            if overrides.get(key) is not None:
                raise refuse(source, key, "only a dynamic loss scale has a floor or a cap",
                             "remove it, or use loss_scale='dynamic'")
    return d.build()


def _call_kwargs(text: str, source: str) -> dict[str, Any] | None:
    """The keyword arguments of the ``amp.initialize(...)`` call in ``text`` (verbatim code such as
    ``model, optimizer = amp.initialize(model, optimizer, opt_level="O1")``), or None when there is none.
    ``torch.float16``-style values are read as dtype names; anything else must be a literal."""
    import ast
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute | ast.Name)
             and (n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id) == "initialize"]
    if not calls:
        return None
    if len(calls) > 1:
        raise bad(source, "initialize", f"{len(calls)} amp.initialize calls; pass the one to import")
    out: dict[str, Any] = {}
    call = calls[0]
    for kw in call.keywords:
        if kw.arg is None:
            raise bad(source, "initialize", "**kwargs cannot be read; write the keyword arguments out")
        node = kw.value
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            out[kw.arg] = f"torch.{node.attr}"
            continue
        try:
            out[kw.arg] = ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            raise bad(source, kw.arg, f"{ast.unparse(node)[:60]} is not a literal (unimp executes nothing); write the "
                                      f"value the run uses, e.g. {kw.arg}='O2'") from None
    if len(call.args) > 2:
        raise bad(source, "initialize", "more than (models, optimizers) positional arguments; pass the rest by "
                                        "keyword")
    return out


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, dict) and "opt_level" not in raw:
        raise bad(source, "opt_level", "not given: the input holds no amp.initialize opt_level; pass it (O0-O3)")
    if isinstance(raw, dict):
        given = dict(raw)
        return import_policy(given.pop("opt_level", "O1"), source=source, **given)
    if isinstance(raw, str) and "=" not in raw and "(" not in raw:
        return import_policy(raw.strip().strip("'\""), source=source)
    if isinstance(raw, str) and raw.strip()[:2] in LEVELS and raw.strip()[2:3] in (",", ";", " "):
        level, rest = raw.strip()[:2], raw.strip()[3:]
        raw = f"opt_level={level!r}, {rest}" if rest.strip() else f"opt_level={level!r}"
    kw = _call_kwargs(raw, source) if isinstance(raw, str) else None
    if kw is None:
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
    if level in ("O2", "O3") and policy.output_cast not in (None, "float32"):  # "unchanged": apex casts (listed)
        cfg["cast_model_outputs"] = f"torch.{policy.output_cast}"
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
    elif ls.mode == "none" and default.loss_scale.mode != "none":
        cfg["loss_scale"] = 1.0
    args = ", ".join(f"{k}={v!r}" for k, v in cfg.items())
    text = f"model, optimizer = amp.initialize(model, optimizer, {args})\n"
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(**c))
