"""PaddleNLP: the precision arguments of ``paddlenlp.trainer.TrainingArguments`` (PaddleNLP's
``llm/config/*/*.json`` argument files, a YAML of them, or a command line ``--bf16 --fp16_opt_level O2``),
both directions. The Trainer turns them into Paddle's own calls, which :mod:`unimp.migrate.paddle` imports.

Read from PaddlePaddle/PaddleNLP (paddlenlp/trainer/training_args.py, trainer.py, argparser.py):

- ``fp16`` / ``bf16`` (both true: ``TrainingArguments.__post_init__`` raises "At most one of fp16 and bf16 can
  be True, but not both"): ``Trainer.autocast_smart_context_manager`` runs ``paddle.amp.auto_cast(True,
  custom_black_list={"reduce_sum", "c_softmax_with_cross_entropy"} | amp_custom_black_list,
  custom_white_list=({"lookup_table", "lookup_table_v2"} at O2) | amp_custom_white_list, level=fp16_opt_level,
  dtype="float16" / "bfloat16")``; neither: no autocast (float32).
- ``fp16_opt_level`` (default "O1"): at O2 ``Trainer._wrap_amp_model`` calls ``paddle.amp.decorate(models,
  level="O2", dtype)`` and ``Trainer.create_optimizer`` passes ``multi_precision=True``: float32 master weights.
- ``scale_loss`` (default 2**15): ``paddle.amp.GradScaler(init_loss_scaling=scale_loss)`` (``_wrap_amp_model``;
  the other knobs Paddle's defaults), used for fp16 only (``do_grad_scaling = True if args.fp16``): bf16 unscaled.
- ``amp_master_grad``: ``mix_precision_utils.MixPrecisionLayer(model, dtype)`` (``Trainer._wrap_model``): float32
  gradients at O2, what Paddle's ``decorate(master_grad=True)`` keeps; at O1 the float32 parameters' gradients are
  float32 already; with neither fp16 nor bf16 ``__post_init__`` sets it False.
- A JSON file is read as ``PdArgumentParser.read_json`` reads it (each value handed over as ``--key str(value)``:
  booleans through ``strtobool``, a list as its items); the other keys (model, data, parallelism) are listed as
  ignored. ``enable_auto_parallel`` (AutoTrainer, its strategy's amp) is refused.

>>> import_policy({"bf16": True, "fp16_opt_level": "O2", "learning_rate": 3e-5}).policy.param_dtype
'bfloat16'
>>> export_policy(import_policy({"fp16": True, "scale_loss": 1024}).policy).config
{'fp16': True, 'scale_loss': 1024.0}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unimp.errors import PolicyError, UnsupportedError
from unimp.migrate.draft import Exported, Imported, relabel
from unimp.migrate.export_check import finish, merge_into
from unimp.migrate.paddle import NLP_BOOLS, NLP_LISTS, NLP_PRECISION
from unimp.migrate.parsing import pasted_arguments
from unimp.migrate.values import bad, number, refuse
from unimp.policy import Policy
from unimp.policy.ops import kind_of
from unimp.policy.spec import short, show

SYSTEM = "paddlenlp"
BOOLS, LISTS = NLP_BOOLS, NLP_LISTS  # kept in unimp.migrate.paddle, whose hint names --from paddlenlp
LEVELS = ("O0", "O1", "O2", "OD")  # what Trainer hands to auto_cast(level=...) as given (O2: decorate too)
PRECISION = NLP_PRECISION
OWNED = ("fp16", "bf16", "fp16_opt_level", "scale_loss", "amp_master_grad", *LISTS)  # what export writes
SCALE_LOSS = 2.0 ** 15  # training_args.py: scale_loss: float = field(default=2**15)
TRAINER_BLACK = ("reduce_sum", "c_softmax_with_cross_entropy")  # autocast_smart_context_manager, every level
TRAINER_O2_WHITE = ("lookup_table", "lookup_table_v2")  # its O2 additions: "we need it return fp16"


def import_policy(args: Mapping[str, Any], *, source: str = "TrainingArguments") -> Imported:
    """The policy PaddleNLP's Trainer trains with under ``args`` (TrainingArguments as a dict)."""
    from unimp.migrate import paddle
    from unimp.migrate.hf_trainer import _read_keys, _truth

    if not isinstance(args, Mapping):
        raise bad(source, "", f"expected TrainingArguments (a table), got {show(args)}")
    for k in args:
        if isinstance(k, str) and "-" in k and k.replace("-", "_") in PRECISION:
            raise bad(source, k, f"PdArgumentParser has no --{k} (its flags are the field names); write "
                                 f"{k.replace('-', '_')}")
    on = {k: _truth(source, k, args[k]) for k in BOOLS if args.get(k) is not None}
    if on.get("fp16") and on.get("bf16"):
        raise bad(source, "bf16", "true with fp16 true: TrainingArguments.__post_init__ raises 'At most one of fp16 "
                                  "and bf16 can be True, but not both'; keep one")
    if on.get("enable_auto_parallel"):
        raise refuse(source, "enable_auto_parallel", "true: AutoTrainer runs the auto-parallel strategy's amp "
                     "(training_args.py __post_init__ sets strategy.amp from these keys, without the Trainer's own "
                     "op lists), which this importer does not read",
                     "import the arguments of a Trainer run (without enable_auto_parallel)")
    if "fp16" not in args and "bf16" not in args:
        raise bad(source, "bf16", "not given: the arguments hold no fp16 / bf16 (TrainingArguments defaults both to "
                                  "False: float32); add bf16: false to import float32")
    level, scale = _level(args, source), _scale(args, source)
    white, black = (_names(args, source, k) for k in LISTS)
    rest = tuple(k for k in args if k not in PRECISION)
    notes = [f"{k}: the model is cast for evaluation only (evaluation_loop); not the training numerics"
             for k in ("fp16_full_eval", "bf16_full_eval") if on.get(k)]
    dtype = "float16" if on.get("fp16") else "bfloat16" if on.get("bf16") else None
    if dtype is None:
        notes.append("fp16 and bf16 false: the Trainer opens no autocast and builds no GradScaler (float32)"
                     + ("; amp_master_grad is set False by __post_init__" if on.get("amp_master_grad") else ""))
        imp = paddle.import_policy({"enable": False}, source=source)
        return relabel(imp, SYSTEM, source, "fp16 / bf16 false: float32", rest,
                       _read_keys(args, imp.text, notes, PRECISION))
    table = paddle.paddle_names()
    o2_white = tuple(n for n in table["embedding"] if n[:1].islower()) if level == "O2" else ()
    _no_overlap(white, black, o2_white, table, source)
    ac = {"level": level, "dtype": dtype, "custom_white_list": list(dict.fromkeys([*white, *o2_white])),
          "custom_black_list": list(dict.fromkeys([*black, *TRAINER_BLACK]))}
    notes.append(f"Trainer.autocast_smart_context_manager: auto_cast(level={level!r}, dtype={dtype!r}) with the "
                 f"Trainer's own black list {', '.join(TRAINER_BLACK)}"
                 + (f" and, at O2, white list {', '.join(TRAINER_O2_WHITE)} (the embedding lookup, v1 and v2 names: "
                    f"canonical op embedding, {', '.join(o2_white)})" if o2_white else "")
                 + " added to amp_custom_white_list / amp_custom_black_list")
    master_grad = bool(on.get("amp_master_grad"))
    decorate = None
    if level == "O2":
        decorate = {"level": "O2", "dtype": dtype, "master_grad": master_grad}
        notes.append("fp16_opt_level O2: Trainer._wrap_amp_model decorate(models, level='O2', dtype) and "
                     "create_optimizer(multi_precision=True): float32 master weights"
                     + ("; amp_master_grad: _wrap_model MixPrecisionLayer keeps float32 gradients (decorate's "
                        "master_grad)" if master_grad else ""))
    elif master_grad:
        notes.append(f"amp_master_grad at {level}: MixPrecisionLayer on float32 parameters, whose gradients are "
                     f"float32 already (nothing changes)")
    scaler = {"init_loss_scaling": scale} if dtype == "float16" else None
    if dtype == "float16":
        notes.append(f"fp16: GradScaler(init_loss_scaling=scale_loss = {scale:g}) (Trainer._wrap_amp_model; "
                     f"do_grad_scaling)")
    else:
        notes.append("bf16: do_grad_scaling is False (Trainer._wrap_amp_model): loss.backward() unscaled"
                     + ("; scale_loss unused" if "scale_loss" in args else ""))
    imp = _named(paddle.import_policy(ac, scaler, source=source, decorate=decorate, lists_key="amp_"), ac,
                 len(white), len(black), "scale_loss" in args)
    why = f"{'fp16' if dtype == 'float16' else 'bf16'}, fp16_opt_level {level}: the Trainer's auto_cast" + (
        " + decorate" if decorate else "") + (" + GradScaler" if scaler else "")
    return relabel(imp, SYSTEM, source, why, rest, _read_keys(args, imp.text, notes, PRECISION))


def _named(imp: Imported, ac: Mapping[str, Any], whites: int, blacks: int, scale_given: bool) -> Imported:
    """``imp`` with its comments naming PaddleNLP's keys: the Trainer's own list entries (after the user's
    ``whites`` / ``blacks`` in ``ac``) as the Trainer's, ``GradScaler.init_loss_scaling`` as ``scale_loss``."""
    import re

    def origin(m: re.Match[str]) -> str:
        kind, i = m.group(1), int(m.group(2))
        if i < (whites if kind == "white" else blacks):
            return m.group(0)
        if kind == "white":
            return f"the Trainer's O2 white list ({', '.join(TRAINER_O2_WHITE)})"
        return f"the Trainer's own black list ({ac['custom_black_list'][i]})"

    text = re.sub(r"amp_custom_(white|black)_list\[(\d+)\]", origin, imp.text)
    scale = "scale_loss" if scale_given else "scale_loss not given: 2**15"
    text = text.replace("# GradScaler.init_loss_scaling", f"# {scale} (GradScaler(init_loss_scaling=...))")
    return Imported(imp.system, imp.policy, text, imp.ignored)


def _level(args: Mapping[str, Any], source: str) -> str:
    level = args.get("fp16_opt_level", "O1")
    if not isinstance(level, str) or level not in LEVELS:
        raise bad(source, "fp16_opt_level", f"{short(level)} is not one of {', '.join(LEVELS)} (the Trainer compares "
                                            f"it to 'O2' as written and hands it to auto_cast(level=...))")
    return level


def _scale(args: Mapping[str, Any], source: str) -> float:
    """``scale_loss`` as argparse reads it (``type=float``: a JSON value arrives as its text)."""
    value = args.get("scale_loss", SCALE_LOSS)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise bad(source, "scale_loss", f"{short(value)} is not a number") from None
    scale: float = number(source, "scale_loss", value)
    if not 0 < scale < float("inf"):
        raise bad(source, "scale_loss", f"{scale:g}: the initial loss scale must be a positive finite number")
    return scale


def _names(args: Mapping[str, Any], source: str, key: str) -> list[Any]:
    value = args.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        raise bad(source, key, f"{short(value)} is a string, not a list: PdArgumentParser hands it over as one op "
                               f"name (read_json: --{key} str(value)) and the Trainer extends its list with it, so "
                               f"Paddle moves no op; write a list ([\"reduce_sum\", ...])")
    if not isinstance(value, list | tuple):
        raise bad(source, key, f"expected a list of Paddle op names, got {show(value)}")
    for i, name in enumerate(value):
        if not isinstance(name, str):
            raise bad(source, f"{key}[{i}]", f"expected a Paddle op name (a string), got {show(name)}")
    return list(value)


def _no_overlap(white: list[Any], black: list[Any], o2_white: tuple[str, ...], table: Mapping[str, Any],
                source: str) -> None:
    """The user's lists against each other and the Trainer's own: Paddle's auto_cast raises on a name in both
    lists (``_update_list``: 'Custom white list overlap custom black list'); unimp places a canonical op in
    one list, so one named in both (``sum`` and the Trainer's ``reduce_sum``) is refused too."""
    mine = {"amp_custom_white_list": white, "amp_custom_black_list": black}
    theirs = {"amp_custom_white_list": (*black, *TRAINER_BLACK), "amp_custom_black_list": (*white, *o2_white,
                                                                                         *TRAINER_O2_WHITE)}
    for key, names in mine.items():
        other = theirs[key]
        ops = {kind_of(n, table): n for n in other if isinstance(n, str)}
        for i, n in enumerate(names):
            if not isinstance(n, str):
                continue
            hit = n if n in other else ops.get(kind_of(n, table)) if kind_of(n, table) else None
            if hit is None:
                continue
            whose = "amp_custom_black_list" if key.endswith("white_list") else "amp_custom_white_list"
            if hit not in (black if key.endswith("white_list") else white):
                whose = "the Trainer's own " + ("black list" if key.endswith("white_list") else "O2 white list")
            why = ("Paddle's auto_cast raises 'Custom white list overlap custom black list'" if hit == n else
                   f"{n} and {hit} are one canonical op ({kind_of(n, table)}), which runs in one dtype")
            raise bad(source, f"{key}[{i}]", f"{short(n)} is also in {whose} ({hit}): {why}; remove it")


def parse_command_line(text: str, source: str) -> dict[str, Any]:
    """``--bf16 --fp16_opt_level O2 --amp_custom_black_list reduce_sum sin`` as PdArgumentParser reads it: a
    boolean flag alone is true (``nargs="?", const=True``, strtobool), a list takes every value up to the next
    flag (``nargs="+"``); the launcher and script words (``python -m paddle.distributed.launch ... run.py``) as
    the shell reads them. A positional ``*.json`` is the arguments file the flags override
    (``parse_json_file_and_cmd_lines``)."""
    from unimp.migrate.megatron import _expand, _words

    words, assigned, _, _ = _words(text, source)
    out: dict[str, Any] = {}
    files: list[str] = []
    i = 0
    while i < len(words):
        word = _expand(words[i], assigned)
        i += 1
        if not word.startswith("--"):
            files += [word] if word.endswith(".json") else []
            continue
        key, eq, value = word[2:].partition("=")
        if key in out:
            raise bad(source, f"--{key}", "given twice; argparse keeps the last, easy to miss: keep one")
        if key in LISTS:
            out[key] = [value] if eq else []
            while not eq and i < len(words) and not words[i].startswith("-"):
                out[key].append(_expand(words[i], assigned))
                i += 1
            if not out[key]:
                raise bad(source, f"--{key}", "no op names (argparse: expected at least one argument)")
        elif eq:
            out[key] = value
        elif i < len(words) and not words[i].startswith("-"):  # nargs="?" takes it (a bool: strtobool)
            out[key], i = _expand(words[i], assigned), i + 1
        else:
            out[key] = True
    if files:
        path = Path(files[0])
        if not path.is_file():
            raise refuse(source, files[0], "no such file here: the arguments are in that JSON file (the flags "
                         "override it: PdArgumentParser.parse_json_file_and_cmd_lines)",
                         f"run from the directory it is relative to, or import it: `unimp import {files[0]} "
                         f"--from paddlenlp`")
        from unimp.cli import _read_source

        given, _ = _read_source(str(path), SYSTEM)
        if not isinstance(given, Mapping):
            raise bad(source, files[0], f"expected a JSON table of TrainingArguments, got {show(given)}")
        out = {**given, **out}
    if not out:
        raise bad(source, "", f"cannot read {short(text)}: expected TrainingArguments (--bf16, --fp16_opt_level O2 "
                              f"...) or their JSON / YAML file")
    return out


def _is_command_line(text: str) -> bool:
    """Flags, or ``python run_finetune.py args.json`` (no flag: the arguments file alone)."""
    words = text.split()
    return "--" in text or (any(w.endswith(".json") for w in words) and ":" not in words[0])


def from_cli(raw: Any, source: str) -> Imported:
    raw = pasted_arguments(raw, source, parse_command_line, "TrainingArguments (--bf16 --fp16_opt_level O2, a JSON "
                           "table or YAML lines bf16: true)", _is_command_line)
    return import_policy(raw, source=source)


def export_policy(policy: Policy, into: Mapping[str, Any] | None = None) -> Exported:
    """TrainingArguments keys for the policy (``fp16`` / ``bf16``, ``fp16_opt_level`` O2 for low parameters,
    ``scale_loss``, ``amp_master_grad`` for float32 gradients, the custom lists for ops placed otherwise than
    the Trainer's), the candidate that re-imports closest. ``into``: the user's arguments file, only these
    keys changed."""
    from unimp.migrate import paddle

    mp = {"float16": "fp16", "bfloat16": "bf16"}.get(policy.compute_dtype)
    cfg: dict[str, Any] = {"fp16": False, "bf16": False}
    if mp is not None:
        o2 = policy.param_dtype != "float32"
        cfg = {mp: True, **({"fp16_opt_level": "O2"} if o2 else {})}
        ls = policy.loss_scale
        if mp == "fp16" and ls.mode != "none" and ls.initial != SCALE_LOSS:
            cfg["scale_loss"] = ls.initial
        if o2 and policy.distributed.reduce_dtype == "float32":
            cfg["amp_master_grad"] = True
    cands = [cfg]
    if mp is not None:
        white, black = paddle.custom_lists(policy, import_policy(cfg, source="export").policy)
        lists = {k: v for k, v in zip(LISTS, (white, black), strict=True) if v}
        if lists:
            cands.insert(0, {**cfg, **lists})
    outs = []
    for c in cands:
        try:
            outs.append(finish(SYSTEM, policy, c, "", lambda x: import_policy(x, source="export")))
        except (PolicyError, UnsupportedError):  # lists the Trainer's own would overlap
            continue
    best = min(outs, key=lambda o: len(o.unexpressed))
    out, unexpressed = dict(best.config), best.unexpressed
    changed: tuple[str, ...] = ()
    if into is not None:
        out, changed = merge_into(into, out, OWNED)
        try:
            unexpressed = finish(SYSTEM, policy, out, "", lambda x: import_policy(x, source="export --into")
                                 ).unexpressed
        except (PolicyError, UnsupportedError) as e:
            unexpressed = (f"the merged arguments cannot be checked ({e})",)
    text = json.dumps(out, indent=2) + "\n" if into is not None else _flags(out)
    return Exported(SYSTEM, out, text, unexpressed, changed)


def _flags(cfg: Mapping[str, Any]) -> str:
    """The arguments as a command line and as YAML lines (JSON values: paste them into an llm/config file)."""
    def word(k: str, v: Any) -> str:
        return f"--{k}" if v is True else f"--{k} {' '.join(v)}" if isinstance(v, list) else f"--{k} {v}"

    lines = "".join(f"{k}: {json.dumps(v)}\n" for k, v in cfg.items())
    return f"# command line: {' '.join(word(k, v) for k, v in cfg.items())}\n{lines}"
