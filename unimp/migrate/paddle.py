"""Paddle: ``paddle.amp.auto_cast(level, custom_white_list, custom_black_list, dtype)`` +
``paddle.amp.GradScaler(...)``, or fleet's ``strategy.amp_configs``, both directions.

Defaults read from python/paddle/amp/auto_cast.py (level "O1", dtype "float16"),
python/paddle/amp/grad_scaler.py (GradScaler: init_loss_scaling 2**16, incr_ratio 2.0,
decr_ratio 0.5, incr_every_n_steps 2000, decr_every_n_nan_or_inf 1) and fleet's
distributed_strategy.proto (AMPConfig: init_loss_scaling 32768, incr_every_n_steps 1000,
decr_every_n_nan_or_inf 2, incr_ratio 2, decr_ratio 0.8; the static graph's
update_loss_scaling rule). A native op name in a custom list moves its canonical op
(``unimp ops``) when the list names every op type of it (or the op already runs there); a part
of a canonical op (``tanh`` of ``activation``) is refused, never widened; a name unimp has no
canonical op for is an error. ``use_fp16_guard`` (fleet, default true) is refused in pure mode,
where only ops inside ``fp16_guard()`` blocks run low; ``use_promote`` is read at O2 only.

>>> imp = import_policy({"level": "O1", "custom_black_list": list(paddle_names()["matmul"][:6])},
...                     {"init_loss_scaling": 1024.0})
>>> imp.policy.ops.category("matmul"), imp.policy.loss_scale.initial
('float32', 1024.0)
>>> export_policy(imp.policy).config["auto_cast"]["custom_black_list"][:2]
['bmm', 'einsum']
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

from unimp.errors import UnsupportedError
from unimp.migrate.draft import Draft, Exported, Imported, has_knob, take
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import MAX_TEXT, calls, kwargs_of
from unimp.migrate.values import bad, check_keys, flag, refuse
from unimp.policy import Policy
from unimp.policy.loading import load
from unimp.policy.ops import CANONICAL_OPS, kind_of
from unimp.policy.spec import short, show

SYSTEM = "paddle"


def paddle_names() -> dict[str, tuple[str, ...]]:
    """Paddle's names per canonical op (lower case: op types as in ``paddle.amp``'s white/black lists;
    capitalised: layer classes): the paddle backend's own table (``unimp_paddle.ops.NATIVE_OPS``, read through
    its entry point; Paddle itself is not imported). Only configs whose custom lists name ops need it."""
    from unimp.backend.registry import backends

    cls = backends().get("paddle")
    if cls is None:
        raise UnsupportedError("paddle: custom_white_list / custom_black_list name Paddle ops; their canonical ops "
                               "come from the paddle backend's op table, which is not installed; fix: pip install "
                               "unimp-paddle (Paddle itself is not needed to import: pip install --no-deps "
                               "unimp-paddle)")
    return dict(cls.native_ops)
AUTO_CAST_KEYS = ("enable", "custom_white_list", "custom_black_list", "level", "dtype", "use_promote")
DECORATE_KEYS = ("models", "optimizers", "level", "dtype", "master_weight", "save_dtype", "master_grad",
                 "excluded_layers")
SCALER_KEYS = ("enable", "init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps",
               "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling")
AMP_CONFIG_KEYS = ("init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio",
                   "use_dynamic_loss_scaling", "custom_white_list", "custom_black_list", "custom_black_varnames",
                   "use_pure_fp16", "use_fp16_guard", "use_optimizer_fp16", "use_pure_bf16")
GRAD_SCALER = {"init_loss_scaling": 65536.0, "incr_ratio": 2.0, "decr_ratio": 0.5, "incr_every_n_steps": 2000,
               "decr_every_n_nan_or_inf": 1}
AMP_CONFIGS = {"init_loss_scaling": 32768.0, "incr_ratio": 2.0, "decr_ratio": 0.800000011920929,
               "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2}


def import_policy(auto_cast: Mapping[str, Any] | None = None, grad_scaler: Mapping[str, Any] | None = None, *,
                  source: str = "paddle", decorate: Mapping[str, Any] | None = None,
                  ignored: tuple[str, ...] = (), notes: tuple[str, ...] = (),
                  lists_key: str = "auto_cast.") -> Imported:
    """The policy of ``with paddle.amp.auto_cast(**auto_cast)`` + ``paddle.amp.GradScaler(**grad_scaler)``
    (no GradScaler given: no loss scaling, as the loop then calls ``loss.backward()`` unscaled; warned for
    float16) + ``paddle.amp.decorate(**decorate)``. ``lists_key``: the prefix an error in a custom list
    names (``auto_cast.custom_white_list[0]``; a system passing its own keys, e.g. PaddleNLP's
    ``amp_custom_white_list``, names them)."""
    ac, gs = dict(auto_cast or {}), grad_scaler
    check_keys(ac, AUTO_CAST_KEYS, source, "auto_cast.")
    dec = dict(decorate or {})
    check_keys(dec, DECORATE_KEYS, source, "decorate.")
    level = ac.get("level", dec.get("level", "O1"))
    dtype = ac.get("dtype", dec.get("dtype", "float16"))
    if not isinstance(level, str) or level not in ("O0", "OD", "O1", "O2"):
        raise bad(source, "auto_cast.level", f"{short(level)} is not one of O0, OD, O1, O2")
    if not isinstance(dtype, str) or dtype not in ("float16", "bfloat16"):
        raise bad(source, "auto_cast.dtype", f"{short(dtype)} is not float16 or bfloat16")
    if "level" in dec and dec["level"] != level:
        raise bad(source, "decorate.level", f"{short(dec['level'])} differs from auto_cast's level {level}; keep one")
    if not flag(source, "auto_cast.enable", ac.get("enable", True)) or level == "O0":
        d = Draft(SYSTEM, source, "fp32", "auto_cast disabled (enable=False or level O0)")
        d.ignored.extend(ignored)
        d.notes.extend(notes)
        return d.build()
    promote_notes = []
    if "use_promote" in ac and not flag(source, "auto_cast.use_promote", ac["use_promote"]):
        if level == "O2":
            raise refuse(source, "auto_cast.use_promote", "False at O2 (ops with a float32 input run in the low "
                         "dtype, not promoted) has no policy key", "remove it: unimp promotes the ops in ops.promote")
        promote_notes.append("auto_cast.use_promote (read at level O2 only: python/paddle/amp/auto_cast.py auto_cast)")
    d = Draft(SYSTEM, source, "paddle_o2" if level == "O2" else "paddle_o1", f"auto_cast level {level}")
    d.notes.extend(notes)
    d.ignored.extend([*ignored, *promote_notes])
    d.set("compute_dtype", dtype, "auto_cast.dtype" if "dtype" in ac else "auto_cast.dtype not given: float16")
    if level == "O2":
        _decorate(d, dec, dtype, source)
    elif dec:
        raise bad(source, "decorate", f"paddle.amp.decorate is for level O2 (auto_cast level is {level})")
    base = load(d.extends)
    lists = {"lower": list(base.ops.lower), "float32": list(base.ops.float32), "promote": list(base.ops.promote)}
    origin = f"{d.extends} lists"
    if level == "OD":
        lists = {"lower": lists["lower"], "float32": [o for o in CANONICAL_OPS if o not in lists["lower"]],
                 "promote": []}
        origin = "level OD: only the white list runs low"
    moves = _moves(ac, source, lists_key, lists)
    _apply(d, lists, moves, origin)
    if gs is None:  # auto_cast scales nothing: the loop's loss.backward() runs unscaled without a GradScaler
        d.set("loss_scale.mode", "none", f"no GradScaler given ({dtype})")
        d.set("loss_scale.skip_nonfinite", False, "no GradScaler: every step is taken")
        if dtype == "float16":
            d.note("no GradScaler given: float16 gradients are not scaled; import the paddle.amp.GradScaler(...) "
                   "line too if the loop uses one", warn=True)
        return d.build()
    kw = dict(gs)
    check_keys(kw, SCALER_KEYS, source, "GradScaler.")
    _scaler(d, kw, GRAD_SCALER, "GradScaler.")
    return d.build()


def _decorate(d: Draft, dec: dict[str, Any], dtype: str, source: str) -> None:
    """``paddle.amp.decorate(models, optimizers, level='O2', dtype, master_weight=None, save_dtype=None,
    master_grad=False, excluded_layers=None)`` (python/paddle/amp/auto_cast.py ``amp_decorate``:
    master_weight None means True at O2; master_grad keeps float32 gradients)."""
    if dec.get("excluded_layers") is not None:
        raise refuse(source, "decorate.excluded_layers", "layers are objects a config cannot name",
                     "write an [[overrides]] entry with their class names (types = [...]) and param_dtype float32")
    mw = dec.get("master_weight")
    masters = True if mw is None else flag(source, "decorate.master_weight", mw)
    d.set("param_dtype", dtype, "level O2: decorate casts the parameters")
    d.set("master_weights.enabled", masters, "decorate.master_weight" if mw is not None else
          "decorate.master_weight not given: True at O2")
    master_grad = flag(source, "decorate.master_grad", dec.get("master_grad", False))
    d.set("distributed.reduce_dtype", "float32" if master_grad else dtype,
          "decorate.master_grad: float32 gradients" if master_grad else
          f"decorate.master_grad not set: gradients of the {dtype} parameters are {dtype}")
    for k in ("save_dtype", "models", "optimizers"):
        if k in dec:
            d.ignored.append(f"decorate.{k} ({'checkpoint dtype' if k == 'save_dtype' else 'objects'})")


def import_paddleclas(config: Mapping[str, Any], *, source: str = "PaddleClas") -> Imported:
    """A PaddleClas config's ``AMP`` section as PaddleClas runs it (ppcls/engine/engine.py
    ``Engine._init_amp``: use_amp default True when the section is there, level O1/O2 (others become
    O1), use_promote, ``build_scaler`` -> ``paddle.amp.GradScaler(init_loss_scaling=scale_loss (1.0),
    use_dynamic_loss_scaling (False))``, O2 ``paddle.amp.decorate(level, save_dtype='float32')``;
    ppcls/utils/amp.py ``AutoCast``: ``paddle.amp.auto_cast(level=amp_level)``, ``use_promote`` passed only
    under Paddle 2.5)."""
    amp = config.get("AMP")
    others = tuple(f"{k} (not the AMP section)" for k in config if k != "AMP")
    if amp is None:
        raise bad(source, "AMP", "nothing read: no AMP section (PaddleClas trains in float32 without one)")
    if not isinstance(amp, Mapping):
        raise bad(source, "AMP", "expected a table")
    check_keys(amp, ("use_amp", "scale_loss", "use_dynamic_loss_scaling", "use_promote", "level", "use_fp16_test"),
               source, "AMP.")
    use = flag(source, "AMP.use_amp", amp.get("use_amp", True))
    ignored = (*others, "AMP.use_fp16_test (evaluation only)")
    if "use_promote" in amp:  # ppcls/utils/amp.py AutoCast passes it only when paddle.__version__[:3] is 2.5/0.0
        flag(source, "AMP.use_promote", amp["use_promote"])
        ignored += ("AMP.use_promote (AutoCast passes it to auto_cast only under Paddle 2.5; later Paddle runs "
                    "auto_cast's default True)",)
    if not use:
        ignored += tuple(f"AMP.{k} (use_amp is False)" for k in amp if k not in ("use_amp", "use_fp16_test",
                                                                                "use_promote"))
        return import_policy({"enable": False}, source=source, ignored=ignored,
                             notes=("AMP.use_amp False: AutoCast(False) and build_scaler(False) (no AMP)",))
    level = amp.get("level", "O1")
    level = level if level in ("O1", "O2") else "O1"  # Engine._init_amp: anything else is set to O1
    ac = {"level": level}
    gs = {"init_loss_scaling": amp.get("scale_loss", 1.0),
          "use_dynamic_loss_scaling": amp.get("use_dynamic_loss_scaling", False)}
    said = [f"AMP.{k}={amp[k]!s:.40}" for k in ("use_amp", "level", "scale_loss", "use_dynamic_loss_scaling")
            if k in amp]
    note = (f"PaddleClas Engine._init_amp: {', '.join(said) or 'AMP section'} -> auto_cast(level={level!r}), "
            f"GradScaler(init_loss_scaling={gs['init_loss_scaling']!s:.40}, use_dynamic_loss_scaling="
            f"{gs['use_dynamic_loss_scaling']!s:.10})" + (", decorate(level='O2', save_dtype='float32')"
                                                          if level == "O2" else ""))
    return import_policy(ac, gs, source=source, ignored=ignored, notes=(note,),
                         decorate={"level": level, "save_dtype": "float32"} if level == "O2" else None)


def import_amp_configs(amp_configs: Mapping[str, Any], *, source: str = "paddle amp_configs") -> Imported:
    """The policy of fleet ``strategy.amp = True; strategy.amp_configs = amp_configs`` (static graph)."""
    if not isinstance(amp_configs, Mapping):
        raise bad(source, "amp_configs", f"expected a table of AMPConfig keys, got {show(amp_configs)}")
    cfg = dict(amp_configs)
    check_keys(cfg, AMP_CONFIG_KEYS, source, "amp_configs.")
    if cfg.get("custom_black_varnames"):
        raise refuse(source, "amp_configs.custom_black_varnames", "variables are named per program, not per op",
                     "move those layers to float32 with an [[overrides]] entry (modules = [...])")
    if cfg.get("use_optimizer_fp16"):
        raise refuse(source, "amp_configs.use_optimizer_fp16", "fp16 optimizer states have no policy key",
                     "remove it (unimp keeps optimizer state in float32)")
    bf16 = flag(source, "amp_configs.use_pure_bf16", cfg.get("use_pure_bf16", False))
    pure = flag(source, "amp_configs.use_pure_fp16", cfg.get("use_pure_fp16", False)) or bf16
    # AMPConfig.use_fp16_guard defaults to true (distributed_strategy.proto); AMPOptimizer passes it to
    # static.amp.decorate only in pure mode ("use_fp16_guard is not support amp-o1":
    # fleet/meta_optimizers/amp_optimizer.py _init_wrapped_opt)
    guard = flag(source, "amp_configs.use_fp16_guard", cfg.get("use_fp16_guard", True))
    if pure and guard:
        raise refuse(source, "amp_configs.use_fp16_guard", "true (the proto default) with pure fp16/bf16: only ops "
                     "built inside paddle.static.amp.fp16_guard() blocks run in the low dtype, which depends on the "
                     "program, not the config", "set use_fp16_guard: false (every op follows the lists) to import")
    d = Draft(SYSTEM, source, "paddle_static_o1", "fleet amp (static graph update_loss_scaling rule)")
    if bf16:
        d.set("compute_dtype", "bfloat16", "amp_configs.use_pure_bf16")
    if pure:
        d.set("param_dtype", "bfloat16" if bf16 else "float16",
              "amp_configs.use_pure_bf16" if bf16 else "amp_configs.use_pure_fp16")
        d.set("master_weights.enabled", True, "pure AMP keeps float32 masters")
    base = load(d.extends)
    lists = {"lower": list(base.ops.lower), "float32": list(base.ops.float32), "promote": list(base.ops.promote)}
    _apply(d, lists, _moves(cfg, source, "amp_configs.", lists), f"{d.extends} lists")
    _scaler(d, cfg, AMP_CONFIGS, "amp_configs.")
    if not pure and "use_fp16_guard" in cfg:
        d.ignored.append("amp_configs.use_fp16_guard (read with pure fp16/bf16 only)")
    return d.build()


def _moves(given: Mapping[str, Any], source: str, prefix: str,
           lists: Mapping[str, list[str]] | None = None) -> dict[str, tuple[str, str]]:
    """canonical op -> (list, source key) from custom_white_list / custom_black_list.

    unimp moves whole canonical ops; a Paddle op type that is one of several of its canonical op
    (``tanh`` of ``activation``) would move its siblings too, so it is accepted only when the op
    already runs where the list puts it, or when every op type of that canonical op is listed;
    otherwise it is refused with the reason (never widened)."""
    moves: dict[str, tuple[str, str]] = {}
    listed: dict[str, dict[str, set[str]]] = {}
    table = paddle_names() if any(given.get(k) for k in ("custom_white_list", "custom_black_list")) else {}
    for key, target in (("custom_white_list", "lower"), ("custom_black_list", "float32")):
        names = given.get(key) or []
        if isinstance(names, str | bytes) or not isinstance(names, list | tuple | set | frozenset):
            raise bad(source, f"{prefix}{key}", "expected a list of op names")
        for i, name in enumerate(sorted(names) if isinstance(names, set | frozenset) else names):
            op = kind_of(name, table) if isinstance(name, str) else None
            where = f"{prefix}{key}[{i}]"
            if op is None:
                raise refuse(source, where, f"{short(name)} is not an op unimp controls (no canonical op has it)",
                             "remove it, or use one of the Paddle names `unimp ops` lists")
            if op in moves and moves[op][0] != target:
                raise bad(source, where, f"{short(name)} is also in {moves[op][1]} (canonical op {op}); keep one")
            moves[op] = (target, where)
            listed.setdefault(op, {}).setdefault(target, set()).add(name)
    for op, (target, where) in list(moves.items()):
        if lists is not None and op in lists[target]:
            del moves[op]  # already runs there: the list changes nothing
            continue
        siblings = sorted(n for n in table[op] if n[:1].islower())
        missing = [n for n in siblings if n not in listed[op][target]]
        if missing and len(siblings) > 1:
            raise refuse(source, where, f"{', '.join(sorted(listed[op][target]))} is only part of canonical op "
                         f"{op!r} ({', '.join(siblings)}); unimp moves whole canonical ops, so importing it would "
                         f"also move {', '.join(missing)}",
                         f"list all of {', '.join(siblings)} to move the whole op, or remove it (Paddle then runs "
                         f"it as the level's lists say)")
    return moves


def _apply(d: Draft, lists: dict[str, list[str]], moves: dict[str, tuple[str, str]], origin: str) -> None:
    for op, (target, _) in moves.items():
        for name in lists:
            if op in lists[name]:
                lists[name].remove(op)
        lists[target].append(op)
    for name, ops in lists.items():
        why = [f"{op} <- {where}" for op, (t, where) in moves.items() if t == name]
        d.set(f"ops.{name}", ops, origin + (f" + {', '.join(why)}" if why else ""))


def _scaler(d: Draft, kw: dict[str, Any], defaults: Mapping[str, Any], prefix: str) -> None:
    if not flag(d.source, f"{prefix}enable", kw.get("enable", True)):
        d.set("loss_scale.mode", "none", f"{prefix}enable=False")
        d.set("loss_scale.skip_nonfinite", False, f"{prefix}enable=False: every step is taken")
        return
    dynamic = take(d, "loss_scale.mode", kw, "use_dynamic_loss_scaling", True, kind=bool, prefix=prefix,
                   convert=lambda on: "dynamic" if on else "static")
    take(d, "loss_scale.initial", kw, "init_loss_scaling", defaults["init_loss_scaling"], prefix=prefix)
    if dynamic == "static":
        return
    take(d, "loss_scale.growth_factor", kw, "incr_ratio", defaults["incr_ratio"], prefix=prefix)
    take(d, "loss_scale.backoff_factor", kw, "decr_ratio", defaults["decr_ratio"], prefix=prefix)
    take(d, "loss_scale.growth_interval", kw, "incr_every_n_steps", defaults["incr_every_n_steps"], kind=int,
         prefix=prefix)
    take(d, "loss_scale.hysteresis", kw, "decr_every_n_nan_or_inf", defaults["decr_every_n_nan_or_inf"], kind=int,
         prefix=prefix, minimum=1)
    if has_knob("loss_scale.factor_arithmetic"):
        d.set("loss_scale.factor_arithmetic", "float32", "Paddle multiplies in float32")


POSITIONAL = {"auto_cast": ("enable", "custom_white_list", "custom_black_list", "level", "dtype", "use_promote"),
              "amp_guard": ("enable", "custom_white_list", "custom_black_list", "level", "dtype", "use_promote"),
              "GradScaler": ("enable", "init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps",
                             "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling"),
              "decorate": DECORATE_KEYS}
CALLS = {"auto_cast": "auto_cast", "amp_guard": "auto_cast", "GradScaler": "scaler", "amp_configs": "amp_configs",
         "decorate": "decorate"}


def _fleet_lines(text: str, source: str) -> dict[str, Any] | None:
    """``strategy.amp_configs = {...}`` (with ``strategy.amp = True``) as pasted from a fleet script:
    the literal dict, or None when the text holds no such assignment."""
    import ast

    if len(text) > MAX_TEXT:
        raise bad(source, "", f"{len(text)} characters; a pasted configuration is at most {MAX_TEXT}")
    try:
        tree = ast.parse(textwrap.dedent(text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    found: dict[str, Any] | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        attr = target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else ""
        if attr == "amp" and isinstance(node.value, ast.Constant) and node.value.value is False:
            raise bad(source, "strategy.amp", "False: fleet trains without AMP (float32), amp_configs unread; to "
                                              "import that, import 'fp32'")
        if attr == "amp_configs":
            try:
                value = ast.literal_eval(node.value)
            except (ValueError, SyntaxError, RecursionError, MemoryError):
                raise bad(source, "strategy.amp_configs", "not a literal dict; write the values") from None
            if not isinstance(value, dict):
                raise bad(source, "strategy.amp_configs", f"expected a dict, got {show(value)}")
            found = value
    return found


# PaddleNLP's Trainer keys (unimp.migrate.paddlenlp reads them; here for the hint that names --from paddlenlp)
NLP_BOOLS = ("fp16", "bf16", "amp_master_grad", "fp16_full_eval", "bf16_full_eval", "enable_auto_parallel")
NLP_LISTS = ("amp_custom_white_list", "amp_custom_black_list")
NLP_PRECISION = (*NLP_BOOLS, *NLP_LISTS, "fp16_opt_level", "scale_loss")


def _paddlenlp_arguments(raw: Any, source: str) -> None:
    """A located error naming ``--from paddlenlp`` when ``raw`` (a file's table, pasted JSON or a command
    line) holds PaddleNLP ``TrainingArguments`` (``fp16``, ``fp16_opt_level``, ``scale_loss`` ...) and
    nothing of Paddle's own calls or fleet's ``amp_configs``."""
    import re

    ours = {*AMP_CONFIG_KEYS, *AUTO_CAST_KEYS, *CALLS, "strategy"}
    if isinstance(raw, Mapping):
        keys = [k for k in raw if k in NLP_PRECISION] if not ours & set(raw) else []
    elif isinstance(raw, str) and not any(f"{c}(" in raw or f"{c} =" in raw for c in ours):
        found = re.findall(r'(?:^|\s)--(\w+)|"(\w+)"\s*:', raw)  # flags, JSON keys
        keys = [k for pair in found for k in pair if k in NLP_PRECISION]
    else:
        keys = []
    if keys:
        raise bad(source, keys[0], "a PaddleNLP TrainingArguments key (paddlenlp.trainer.TrainingArguments: the "
                                   "Trainer's fp16 / bf16 / fp16_opt_level / scale_loss), not Paddle's auto_cast, "
                                   "GradScaler or fleet amp_configs; import it with --from paddlenlp")


def from_cli(raw: Any, source: str) -> Imported:
    _paddlenlp_arguments(raw, source)
    if isinstance(raw, Mapping) and "AMP" in raw:  # a PaddleClas config
        return import_paddleclas(raw, source=source)
    if isinstance(raw, Mapping) and "amp_configs" in raw:
        return import_amp_configs(raw["amp_configs"], source=source)
    roles = {"auto_cast", "amp_guard", "GradScaler", "decorate"}
    if isinstance(raw, Mapping) and raw and not roles & set(raw) and not set(raw) <= set(AUTO_CAST_KEYS):
        return import_amp_configs(raw, source=source)  # a file holding fleet's amp_configs
    fleet = _fleet_lines(raw, source) if isinstance(raw, str) and "amp_configs" in raw else None
    if fleet is not None:
        return import_amp_configs(fleet, source=source)
    for c in calls(raw, source, CALLS) if isinstance(raw, str) else ():
        if c.last == "decorate" and c.name and any(p in c.name for p in ("static.", "fluid.", "mixed_precision.")):
            raise refuse(source, c.name, "the static-graph decorate wraps the optimizer with its own loss scaling, "
                         "amp_lists and use_pure_fp16 / use_fp16_guard, not the dygraph paddle.amp.decorate; its two "
                         "overloads default differently (python/paddle/static/amp/decorator.py: the use_pure_fp16 "
                         "form 2**15 / 1000 steps / 2 / 0.8, the level form 2**16 / 2000 / 1 / 0.5)",
                         "write its values as fleet amp_configs, e.g. `unimp import "
                         "'strategy.amp_configs = {\"init_loss_scaling\": 32768, \"use_pure_fp16\": False}' "
                         "--from paddle`")
    kw = kwargs_of(raw, source, CALLS, POSITIONAL)
    if "amp_configs" in kw:
        return import_amp_configs(kw["amp_configs"], source=source)
    if not kw.get("auto_cast") and not kw.get("decorate") and "scaler" in kw and "auto_cast" not in kw:
        raise bad(source, "auto_cast", "nothing read about the dtype: only a GradScaler was given; add the "
                                       "paddle.amp.auto_cast(...) line")
    dec = kw.get("decorate")
    return import_policy(kw.get("auto_cast", {"level": dec.get("level", "O1")} if dec else None), kw.get("scaler"),
                         source=source, decorate=dec)


def custom_lists(policy: Policy, base: Policy) -> tuple[list[str], list[str]]:
    """The custom white and black lists (Paddle op types, sorted) that move ``base``'s ops to where
    ``policy`` runs them; ops ``policy`` neither lowers nor keeps in float32 are not listed."""
    white: list[str] = []
    black: list[str] = []
    table = paddle_names()
    for op in CANONICAL_OPS:
        cat = policy.ops.category(op)
        if cat != base.ops.category(op) and cat in ("lower", "float32"):
            names = [n for n in table.get(op, ()) if n[:1].islower()]
            (white if cat == "lower" else black).extend(names)
    return sorted(white), sorted(black)


def export_policy(policy: Policy) -> Exported:
    """``{"auto_cast": {...}, "GradScaler": {...}}``: custom lists hold the ops that differ from the
    level's defaults (their Paddle op types)."""
    level = "O2" if policy.param_dtype != "float32" else "O1"
    ac: dict[str, Any] = {"level": level, "dtype": policy.compute_dtype}
    if policy.compute_dtype == "float32":
        ac = {"enable": False}
    else:
        white, black = custom_lists(policy, load("paddle_o2" if level == "O2" else "paddle_o1"))
        ac.update(custom_white_list=white, custom_black_list=black)
    ls = policy.loss_scale
    gs: dict[str, Any]
    if ls.mode == "none":
        gs = {"enable": False}
    else:
        gs = {"init_loss_scaling": ls.initial, "use_dynamic_loss_scaling": ls.mode == "dynamic"}
        if ls.mode == "dynamic":
            gs.update(incr_ratio=ls.growth_factor, decr_ratio=ls.backoff_factor, incr_every_n_steps=ls.growth_interval,
                      decr_every_n_nan_or_inf=ls.hysteresis)
    cfg = {"auto_cast": ac, "GradScaler": gs}
    text = (f"with paddle.amp.auto_cast({', '.join(f'{k}={v!r}' for k, v in ac.items())}):\n    ...\n"
            f"scaler = paddle.amp.GradScaler({', '.join(f'{k}={v!r}' for k, v in gs.items())})\n")
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(c["auto_cast"], c["GradScaler"]))
