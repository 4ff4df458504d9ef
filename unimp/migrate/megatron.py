"""Megatron-LM: the precision arguments of ``pretrain_gpt.py`` & co., both directions, from a
command line or a whole launch script.

Read from NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553: megatron/training/arguments.py
(``_add_mixed_precision_args`` defaults, ``validate_args``), megatron/core/optimizer
(grad_scaler.py, ``get_megatron_optimizer``), megatron/core/transformer/module.py
(``Float16Module``: the model converted to fp16/bf16, outputs upcast to fp32 on the last stage) and
megatron/core/transformer/transformer_config.py (the ``--fp8-*`` arguments). ``--fp16``: float16
params with float32 main params and ``DynamicGradScaler(initial_scale=--initial-loss-scale 2**32,
min_scale=--min-loss-scale 1.0, growth_factor 2.0, backoff_factor 0.5, growth_interval=
--loss-scale-window 1000, hysteresis=--hysteresis 2)``, or ``ConstantGradScaler(--loss-scale)``;
``--bf16``: bfloat16 params, float32 main params, no scaler unless ``--loss-scale``; gradients are
reduced in the params' dtype unless ``--accumulate-allreduce-grads-in-fp32`` (which ``--bf16``
implies unless ``--grad-reduce-in-bf16``). ``--fp8-format`` runs Transformer Engine's linear layers
in FP8 (recipe ``--fp8-recipe``, default delayed).

A launch script is read as the shell would hand the arguments over: comments dropped, continued
lines joined, quoted variables (``GPT_ARGS="... --fp16 ..."``) and arrays split again, ``$VAR``
values taken from the script's own assignments. Every argument the script mentions is read
(branches are not evaluated). ``--deepspeed`` (Megatron-DeepSpeed) hands the optimizer to
DeepSpeed (bigscience-workshop/Megatron-DeepSpeed megatron/optimizer/__init__.py
``get_megatron_optimizer``: ``if args.deepspeed: return optimizer``): the DeepSpeed config the
script writes (``cat <<EOT > $config_json``) is imported as DeepSpeed. Other arguments are not
precision settings: ignored and listed in the header.

>>> imp = import_policy("--fp16 --loss-scale-window 500 --hysteresis 3 --micro-batch-size 4")
>>> imp.policy.loss_scale.growth_interval, imp.policy.loss_scale.hysteresis, imp.ignored
(500, 3, ('--micro-batch-size',))
>>> import_policy('GPT_ARGS="--fp16 --loss-scale 12" --micro-batch-size 4').policy.loss_scale.initial
12.0
"""

from __future__ import annotations

import json
import re
import shlex
import warnings
from collections.abc import Sequence
from typing import Any

from unimp.errors import UnimpWarning
from unimp.migrate.draft import Draft, Exported, Imported, has_knob, relabel
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import MAX_TEXT, pasted_json
from unimp.migrate.values import bad, number, refuse
from unimp.policy import Policy
from unimp.policy.spec import short

SYSTEM = "megatron"
# Precision arguments unimp has no key for (arguments.py / transformer_config.py): a dtype other than fp32
# for master weights, master gradients or Adam's moments is refused (unimp keeps them float32); the rest
# are noted in the policy file with why they are not held.
STATE_DTYPES = {"--main-params-dtype": "the master weights", "--main-grads-dtype": "the master gradients",
                "--megatron-fsdp-main-params-dtype": "the master weights (Megatron FSDP)",
                "--megatron-fsdp-main-grads-dtype": "the master gradients (Megatron FSDP)",
                "--exp-avg-dtype": "Adam's first moment", "--exp-avg-sq-dtype": "Adam's second moment"}
NOTED = {"--use-precision-aware-optimizer": "lets the *-dtype arguments apply (all fp32 here: as unimp)",
         "--keep-fp8-transpose-cache": "memory only",
         "--ddp-reduce-scatter-with-fp32-accumulation": "the reduce sends low precision but sums in fp32: "
                                                        "unimp's reduce dtype holds one dtype (the wire's, above)",
         "--first-last-layers-bf16": "the first/last transformer layers stay bf16 under FP8 (--num-layers-at-start-"
                                     "in-bf16 / -end-, default 1 each): add [[overrides]] with their module paths "
                                     "and fp8 = false to match",
         "--num-layers-at-start-in-bf16": "see --first-last-layers-bf16",
         "--num-layers-at-end-in-bf16": "see --first-last-layers-bf16",
         "--output-logit-dtype": "the dtype of the LM head's GEMM output: unimp keeps the op's dtype"}
FLAGS = ("--fp16", "--bf16", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16",
         "--fp16-lm-cross-entropy", "--attention-softmax-in-fp32", "--fp8-param-gather", "--deepspeed",
         "--use-precision-aware-optimizer", "--keep-fp8-transpose-cache", "--ddp-reduce-scatter-with-fp32-accumulation",
         "--first-last-layers-bf16")
VALUED = {"--loss-scale": float, "--initial-loss-scale": float, "--min-loss-scale": float,
          "--loss-scale-window": int, "--hysteresis": int, "--fp8-format": str, "--fp8-recipe": str,
          "--fp8-amax-history-len": int, "--fp8-amax-compute-algo": str, "--fp8-margin": int, "--fp8-interval": int,
          "--deepspeed_config": str, "--deepspeed-config": str, "--num-layers-at-start-in-bf16": int,
          "--num-layers-at-end-in-bf16": int, "--output-logit-dtype": str, "--te-precision-config-file": str,
          **dict.fromkeys(STATE_DTYPES, str)}
MAX_WORDS = 20000  # words of one script (bounds the work of re-splitting quoted values)
_HEREDOC = re.compile(r"(?<!<)<<-?(?!<)\s*['\"]?(\w+)['\"]?(.*)$")  # not a here-string (<<<)
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
_VAR = re.compile(r"\$\{([A-Za-z_]\w*)(:?-)([^}$]*)\}|\$\{?([A-Za-z_]\w*)\}?")  # ${V:-default} / $V / ${V}


_POSITIONAL = re.compile(r"""^["']?\$\{?[0-9]\}?["']?;?$""")  # X=$2 in an option-parsing case branch


def _words(text: str, source: str) -> tuple[list[str], dict[str, str], dict[str, str], list[str]]:
    """(words, variable assignments, heredoc bodies by the file they are written to, assignments from
    the script's own arguments that were not applied) of a script."""
    if len(text) > 16 * MAX_TEXT:
        raise bad(source, "", f"{len(text)} characters; a launch script is at most {16 * MAX_TEXT}")
    docs: dict[str, str] = {}
    kept: list[str] = []
    end: str | None = None
    target, body = "", list[str]()
    for line in text.split("\n"):  # heredocs cut out line by line (linear: no regex over the whole text)
        if end is not None:
            if line.strip() == end:
                docs[target], end = "\n".join(body), None
            else:
                body.append(line)
            continue
        if line.lstrip().startswith("#") and line.rstrip().endswith("\\"):
            line = line.rstrip()[:-1]  # a comment ends at its line: its trailing backslash continues nothing
        m = _HEREDOC.search(line)
        if m:
            end, target, body = m.group(1), m.group(2).strip().lstrip(">").strip(), []
            line = line[:m.start()]
        kept.append(line)
    text = "\n".join(kept)
    try:
        first = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as e:
        raise bad(source, "", f"cannot split the command line or script ({e}); check its quotes") from None
    words: list[str] = []
    assigned: dict[str, str] = {}
    positional: list[str] = []
    todo = [(w, 0) for w in reversed(first)]
    while todo:
        word, depth = todo.pop()
        if len(words) > MAX_WORDS:
            raise bad(source, "", f"over {MAX_WORDS} words; pass the training command line itself")
        m = _ASSIGN.match(word)
        if m and not word.startswith("-"):
            name, value = m.group(1), m.group(2).strip().strip("()")
            if name in assigned and _POSITIONAL.match(value):  # `-z) ZERO_STAGE=$2;`: the default stays
                positional.append(f"{name}={value.rstrip(';')}")
                continue
            own = re.compile(r"\$\{" + name + r"\}|\$" + name + r"(?!\w)")
            if name in assigned and own.search(value):  # X="${X}.json": the shell reads X's previous value
                value = own.sub(assigned[name].replace("\\", "\\\\"), value)
            assigned[name] = value
            word = m.group(2).strip("()")
        if depth < 2 and any(c.isspace() for c in word) and "--" in word:
            try:
                todo.extend((w, depth + 1) for w in reversed(shlex.split(word, comments=True)))
            except ValueError:
                words.append(word)
            continue
        if word:
            words.append(word)
    return words, assigned, docs, positional


def _expand(value: str, assigned: dict[str, str], depth: int = 0, defaults: list[str] | None = None) -> str:
    """``$VAR`` / ``${VAR}`` replaced from the script's assignments, ``${VAR:-default}`` by its
    default when the script does not assign VAR (as the shell runs it with VAR unset; recorded in
    ``defaults``); unknown ones left as they are; at most 4 levels deep and MAX_TEXT characters, so
    self-referencing variables stay bounded."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        v = assigned.get(name)
        if v is not None and re.search(r"\$\{?" + name + r"(?!\w)", v):  # PATH="$PATH:..." with no earlier value
            return m.group(0)
        if m.group(1) and (v is None or (v == "" and m.group(2) == ":-")):
            if defaults is not None:
                defaults.append(f"${{{name}{m.group(2)}{m.group(3)}}}")
            v = m.group(3)
        return m.group(0) if v is None or depth > 4 else _expand(v, assigned, depth + 1, defaults)

    out = _VAR.sub(sub, value) if len(value) <= MAX_TEXT else value
    return out if len(out) <= MAX_TEXT else value


def parse_args(args: str | Sequence[str], source: str = "megatron") -> tuple[dict[str, Any], list[str]]:
    """(precision arguments, other argument names) of a Megatron command line or launch script."""
    got, other, _ = _parse(args, source)
    return got, other


def _parse(args: str | Sequence[str], source: str) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    if isinstance(args, str):
        words, assigned, docs, positional = _words(args, source)
    else:  # the bounds of a command line, the same as a script's (and the CLI's)
        if not isinstance(args, Sequence) or len(args) > MAX_WORDS:
            raise bad(source, "", f"over {MAX_WORDS} arguments; pass the training command line itself"
                      if isinstance(args, Sequence) else f"expected a command line (a string or a list of "
                                                         f"strings), got {short(args)}")
        words, assigned, docs, positional = list(args), {}, {}, []
        if not all(isinstance(w, str) for w in words):
            raise bad(source, "", "expected a command line: every argument a string (e.g. ['--fp16', "
                                  "'--loss-scale-window', '1000'])")
    got: dict[str, Any] = {}
    other: list[str] = []
    defaults: list[str] = []
    referenced: set[str] = set()
    i = 0
    while i < len(words):
        word, value = words[i], None
        if word.startswith("--") and "$" in word:  # --${PRECISION:-bf16}: the argument the shell passes
            referenced.update(_names(word))
            expanded = _expand(word, assigned, defaults=defaults)
            word = expanded if "$" not in expanded and expanded.startswith("--") else word
        if word.startswith("--") and "=" in word:
            word, value = word.split("=", 1)
        if word in FLAGS:
            got[word] = True
        elif word in VALUED:
            if value is None:
                if i + 1 >= len(words):
                    raise bad(source, word, "expects a value")
                i += 1
                value = words[i]
            referenced.update(_names(value))
            value = _expand(value, assigned, defaults=defaults)
            if "$" in value and word not in ("--deepspeed_config", "--deepspeed-config", "--te-precision-config-file"):
                raise bad(source, word, f"{short(value)}: the script does not assign that variable; write the value")
            kind = VALUED[word]
            try:
                parsed = kind(value) if kind is str else kind(float(value.replace("_", "")))
                if kind is int and not float(value.replace("_", "")).is_integer():
                    raise ValueError
            except ValueError:
                word_kind = "an integer" if kind is int else "a number"
                raise bad(source, word, f"{short(value)} is not {word_kind}") from None
            if word in got and got[word] != parsed:
                raise bad(source, word, f"given twice ({short(got[word])} and {short(parsed)}); keep the one "
                                        "the run uses")
            got[word] = parsed
        elif word.startswith("--fp8") or word.startswith("--fp4"):
            raise refuse(source, word, "this FP8/FP4 argument has no unimp key",
                         "remove it (unimp reads --fp8-format, --fp8-recipe, --fp8-amax-history-len, "
                         "--fp8-amax-compute-algo, --fp8-margin, --fp8-interval, --fp8-param-gather)")
        elif word.startswith("--"):
            other.append(word)
        i += 1
    return got, list(dict.fromkeys(other)), {"assigned": assigned, "docs": docs, "defaults": defaults,
                                             "positional": positional, "referenced": referenced}


def _names(text: str) -> set[str]:
    """The variables ``text`` refers to (``$V``, ``${V}``, ``${V:-default}``)."""
    return {m.group(1) or m.group(4) for m in _VAR.finditer(text)}


def import_policy(args: str | Sequence[str], *, source: str = "megatron") -> Imported:
    """The policy of a Megatron-LM run with these command-line arguments (or this launch script)."""
    got, other, script = _parse(args, source)
    if got.get("--fp16") and got.get("--bf16"):
        raise bad(source, "--bf16", "--fp16 and --bf16 together (Megatron refuses this); keep one")
    if got.get("--deepspeed"):
        return _deepspeed(got, other, script, source)
    if not (got.get("--fp16") or got.get("--bf16")):
        if not got and not other:
            raise bad(source, "", "no Megatron argument found (they start with --); pass the command line or the "
                                  "launch script, e.g. '--fp16 --loss-scale-window 1000'")
        unset = [w for w in other if "$" in w]
        if unset:
            raise bad(source, unset[0], f"no --fp16 / --bf16 written out, and {', '.join(unset[:3])} come(s) from a "
                                        f"variable the script does not assign (set when it is launched), which may "
                                        f"be the precision; write the argument the run uses (or assign the variable)")
        raise bad(source, "--fp16", "no precision argument (--fp16 / --bf16): the run trains in float32; to import "
                                    "that, import 'fp32' (`unimp show fp32`) — found only "
                                    f"{', '.join(other[:4]) or 'loss-scale arguments'}")
    static = got.get("--loss-scale")
    if got.get("--fp16"):
        d = Draft(SYSTEM, source, "megatron_fp16", "--fp16: Float16Module (fp16 model, fp32 outputs), float32 main "
                                                   "params, DynamicGradScaler")
        if static is None:
            d.set("loss_scale.mode", "dynamic", "--loss-scale not given: DynamicGradScaler")
            for path, key, default in (("initial", "--initial-loss-scale", 2.0 ** 32), ("min", "--min-loss-scale", 1.0),
                                       ("growth_interval", "--loss-scale-window", 1000),
                                       ("hysteresis", "--hysteresis", 2)):
                value = got.get(key, default)
                if path in ("growth_interval", "hysteresis"):
                    value = number(source, key, value, int, minimum=1)
                d.set(f"loss_scale.{path}", value, key if key in got else f"{key} not given: Megatron default")
            d.set("loss_scale.growth_factor", 2.0, "DynamicGradScaler growth_factor 2.0")
            d.set("loss_scale.backoff_factor", 0.5, "DynamicGradScaler backoff_factor 0.5")
            d.set("loss_scale.hysteresis_refill", ["growth"], "DynamicGradScaler refills hysteresis on growth")
            d.set("loss_scale.at_min", "clamp", "DynamicGradScaler stays at min_scale")
            if has_knob("loss_scale.scale_dtype"):
                d.set("loss_scale.scale_dtype", "float32", "DynamicGradScaler holds a float32 tensor")
        if got.get("--grad-reduce-in-bf16"):
            raise bad(source, "--grad-reduce-in-bf16", "applies to --bf16 only; remove it")
        reduce = "float32" if got.get("--accumulate-allreduce-grads-in-fp32") else "float16"
        d.set("distributed.reduce_dtype", reduce, "--accumulate-allreduce-grads-in-fp32" if reduce == "float32"
              else "gradients reduced in the params' dtype (no --accumulate-allreduce-grads-in-fp32)")
    else:
        d = Draft(SYSTEM, source, "megatron_bf16", "--bf16: Float16Module (bf16 model, fp32 outputs), float32 main "
                                                   "params")
        if got.get("--grad-reduce-in-bf16"):
            d.set("distributed.reduce_dtype", "bfloat16", "--grad-reduce-in-bf16")
        else:
            d.set("distributed.reduce_dtype", "float32", "--bf16 implies --accumulate-allreduce-grads-in-fp32 "
                                                         "(arguments.py validate_args)")
    if static is not None:
        d.set("loss_scale.mode", "static", "--loss-scale: ConstantGradScaler")
        d.set("loss_scale.initial", number(source, "--loss-scale", static), "--loss-scale")
        if got.get("--bf16"):
            d.set("loss_scale.skip_nonfinite", True, "--loss-scale: the optimizer skips steps with inf/nan grads")
    for key in ("--initial-loss-scale", "--min-loss-scale", "--loss-scale-window", "--hysteresis"):
        if key in got and (static is not None or got.get("--bf16")):
            d.note(f"{key} is unused without a dynamic scaler (get_megatron_optimizer builds one for --fp16 without "
                   f"--loss-scale only): ignored", warn=True)
    if got.get("--fp16-lm-cross-entropy"):
        _move(d, "loss", "lower", "--fp16-lm-cross-entropy: the LM loss in the model dtype")
    if got.get("--attention-softmax-in-fp32"):
        _move(d, "softmax", "float32", "--attention-softmax-in-fp32")
    _fp8(d, got, source)
    _not_held(d, got, source)
    for note in _launch_notes(script):
        d.note(note, warn=True)
    d.ignored.extend(other)
    return d.build()


def _not_held(d: Draft, got: dict[str, Any], source: str) -> None:
    """The precision arguments unimp has no key for: refused when they change the numerics of what
    unimp keeps in float32, else noted with the reason."""
    if "--te-precision-config-file" in got:
        raise refuse(source, "--te-precision-config-file", "per-module precision read from a Transformer Engine file "
                     "is not read by unimp", "express those modules as [[overrides]] after importing the rest")
    for key, what in STATE_DTYPES.items():
        if key in got and got[key] != "fp32":
            raise refuse(source, key, f"{short(got[key])}: unimp keeps {what} in float32",
                         f"remove {key} (fp32 is its default)")
        if key in got:
            d.note(f"{key} fp32: {what} in float32, as unimp keeps them")
    for key, why in NOTED.items():
        if key in got:
            d.note(f"{key}{'' if got[key] is True else ' ' + str(got[key])}: {why} (not held)",
                   warn=key.startswith(("--first", "--num-layers")))


def _move(d: Draft, op: str, to: str, why: str) -> None:
    from unimp.policy.loading import load

    base = load(d.extends).ops
    lists = {"lower": [o for o in base.lower if o != op], "float32": [o for o in base.float32 if o != op]}
    lists[to].append(op)
    for name in ("lower", "float32"):
        prev = d.keys.get(f"ops.{name}")
        d.set(f"ops.{name}", [o for o in (prev[0] if prev else lists[name]) if o != op] + ([op] if name == to else []),
              why if not prev else f"{prev[1]}; {why}")


def _fp8(d: Draft, got: dict[str, Any], source: str) -> None:
    fmt = got.get("--fp8-format")
    fp8_keys = [k for k in got if k.startswith("--fp8-")]
    if fmt is None:
        if fp8_keys:
            d.note(f"{', '.join(fp8_keys)} without --fp8-format: FP8 is off (transformer_config.py: fp8 None); ignored",
                   warn=True)
        return
    if fmt not in ("e4m3", "hybrid"):
        raise bad(source, "--fp8-format", f"{short(fmt)} is not e4m3 or hybrid")
    recipe = got.get("--fp8-recipe", "delayed")
    if recipe not in ("delayed", "tensorwise"):
        raise refuse(source, "--fp8-recipe", f"{short(recipe)} has no unimp recipe (unimp: delayed, tensorwise)",
                     "use --fp8-recipe delayed or tensorwise")
    d.set("fp8.enabled", True, "--fp8-format")
    d.set("fp8.ops", ["linear"], "--fp8-format: Transformer Engine's linear layers")
    d.set("fp8.recipe", recipe, "--fp8-recipe" if "--fp8-recipe" in got else "--fp8-recipe not given: delayed")
    d.set("fp8.forward_format", "e4m3", "--fp8-format")
    d.set("fp8.gradient_format", "e5m2" if fmt == "hybrid" else "e4m3", "--fp8-format")
    if recipe == "delayed":
        algo = got.get("--fp8-amax-compute-algo", "most_recent")
        if algo not in ("max", "most_recent"):
            raise bad(source, "--fp8-amax-compute-algo", f"{short(algo)} is not max or most_recent")
        for key, want in (("--fp8-margin", 0), ("--fp8-interval", 1)):
            if got.get(key, want) != want:
                raise refuse(source, key, f"{got[key]}: unimp's delayed recipe has {want}", f"pass {key} {want}")
        d.note(f"--fp8-amax-compute-algo {algo}, --fp8-margin {got.get('--fp8-margin', 0)}, --fp8-interval "
               f"{got.get('--fp8-interval', 1)}: unimp's delayed recipe (the max of the amax history, no margin, every "
               f"step)")
        if algo == "most_recent":  # TE _default_get_amax_and_update_history: amax_history[0] = max over 1
            given = "" if "--fp8-amax-compute-algo" in got else " (transformer_config.py default)"
            d.set("fp8.amax_history", 1, f"--fp8-amax-compute-algo most_recent{given}: the scale follows the latest "
                  f"amax only (--fp8-amax-history-len is then unused): unimp's max over a history of 1")
        else:
            d.set("fp8.amax_history", number(source, "--fp8-amax-history-len", got.get("--fp8-amax-history-len", 1),
                                             int, minimum=1),
                  "--fp8-amax-history-len" if "--fp8-amax-history-len" in got else
                  "--fp8-amax-history-len not given: transformer_config.py default 1")
    if got.get("--fp8-param-gather"):
        d.note("--fp8-param-gather: the FP8 layers' weights are all-gathered already quantized (float32 main params "
               "kept); where the cast happens, not a policy key (ignored)")


def _reach(names: set[str], assigned: dict[str, str]) -> set[str]:
    """``names`` and every variable their values refer to."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_names(assigned.get(name, "")) - seen)
    return seen


def _launch_notes(script: dict[str, Any]) -> list[str]:
    """What the launch command may change: ``${VAR:-default}`` read with its default, ``X=$2``
    option branches not applied (the script's own default kept)."""
    notes = []
    if script.get("defaults"):
        notes.append(f"{', '.join(dict.fromkeys(script['defaults']))}: the script does not set it, so the shell "
                     f"passes the default (a value exported before the script runs would change it)")
    used = _reach(script.get("referenced", set()), script.get("assigned", {}))
    positional = [p for p in script.get("positional", []) if p.partition("=")[0] in used]
    if positional:
        notes.append(f"{', '.join(dict.fromkeys(positional))}: set from the script's own arguments (an option it "
                     f"parses); read with the script's default (passing that option would change it)")
    return notes


def _deepspeed(got: dict[str, Any], other: list[str], script: dict[str, Any], source: str) -> Imported:
    """Megatron-DeepSpeed ``--deepspeed``: the DeepSpeed config's fp16/bf16 sections decide."""
    from unimp.migrate import deepspeed

    path = got.get("--deepspeed_config") or got.get("--deepspeed-config")
    fix = f"import that DeepSpeed config: `unimp import {path or 'ds_config.json'} --from deepspeed`"
    if path is None:
        raise refuse(source, "--deepspeed", "Megatron-DeepSpeed hands the optimizer and loss scaling to DeepSpeed "
                     "(get_megatron_optimizer: 'if args.deepspeed: return optimizer') and no --deepspeed_config is "
                     "given", fix)
    body = None
    for target, text in script["docs"].items():
        if target and _expand(target, script["assigned"]) == _expand(path, script["assigned"]):
            body = text
    if body is None:
        raise refuse(source, "--deepspeed_config", f"{short(path)} is not written by this script; "
                     "Megatron-DeepSpeed takes "
                     "its precision from it (get_megatron_optimizer: 'if args.deepspeed: return optimizer')", fix)
    script = {**script, "referenced": script.get("referenced", set()) | _names(body) | _names(path)}
    text = _VAR.sub(lambda m: json.dumps(_expand(m.group(0), script["assigned"])) if "$" in
                    _expand(m.group(0), script["assigned"]) else _expand(m.group(0), script["assigned"]), body)
    cfg = pasted_json(text, source, "--deepspeed_config", "the DeepSpeed config the script writes is not JSON after "
                                                         "its variables are filled in")
    imp = deepspeed.import_policy(cfg, source=f"{source}: --deepspeed_config {path} (the script's heredoc)",
                                  model=lambda d: _deepspeed_model(d, got, other))
    ds_low = {"float16": "--fp16", "bfloat16": "--bf16"}.get(imp.policy.param_dtype)
    for flag in ("--fp16", "--bf16"):
        if got.get(flag) and flag != ds_low:
            raise bad(source, flag, f"the DeepSpeed config the run uses trains in {imp.policy.param_dtype}; Megatron's "
                                    f"{flag} disagrees: make them match")
    ignored = tuple(other) + tuple(k for k in got if k not in ("--fp16", "--bf16", "--deepspeed", "--deepspeed_config",
                                                               "--deepspeed-config"))
    unused = [k for k in got if (k.startswith("--") and "loss-scale" in k) or k == "--hysteresis"]
    notes = (f"{', '.join(unused)}: unused with --deepspeed (get_megatron_optimizer returns the bare optimizer; "
             f"DeepSpeed's fp16 section scales the loss)",) if unused else ()
    launch = tuple(_launch_notes(script))
    for note in launch:
        warnings.warn(f"{source}: {note}", UnimpWarning, stacklevel=2)
    return relabel(imp, SYSTEM, source, "the --deepspeed_config it writes", ignored, notes + launch)


def _deepspeed_model(d: Draft, got: dict[str, Any], other: list[str]) -> None:
    """What Megatron-DeepSpeed's model code adds to the DeepSpeed engine's whole-model low precision.

    pretrain_gpt.py model_provider builds ``GPTModelPipe`` under ``--deepspeed`` (microsoft's: unless
    ``--no-pipeline-parallel``), whose specs end with ``float16_to_fp32`` when ``--fp16``/``--bf16`` is
    given and whose loss is ``vocab_parallel_cross_entropy(output.contiguous().float(), labels)``
    (megatron/model/gpt_model.py ``get_cross_entropy``); the plain ``GPTModel`` returns the logits in
    the model dtype and computes ``vocab_parallel_cross_entropy(output.float(), labels)`` unless
    ``--fp16-lm-cross-entropy`` (``post_language_model_processing``). ``get_model`` returns before the
    ``Float16Module`` wrap (training.py: ``if args.deepspeed: return model``)."""
    pipe = "--no-pipeline-parallel" not in other
    if pipe or not got.get("--fp16-lm-cross-entropy"):
        where = ("GPTModelPipe loss: vocab_parallel_cross_entropy(output.contiguous().float(), labels)" if pipe else
                 "--fp16-lm-cross-entropy not given: post_language_model_processing computes "
                 "vocab_parallel_cross_entropy(output.float(), labels)")
        _move(d, "loss", "float32", where)
    if pipe and (got.get("--fp16") or got.get("--bf16")):
        d.set("output_dtype", "float32", "GPTModelPipe (--deepspeed): its last spec is float16_to_fp32 under "
                                         "--fp16/--bf16")
    if pipe and got.get("--fp16-lm-cross-entropy"):
        d.note("--fp16-lm-cross-entropy: unused by GPTModelPipe (its loss upcasts the logits); ignored", warn=True)


def from_cli(raw: Any, source: str) -> Imported:
    if not isinstance(raw, str | list):
        raise bad(source, "", "expected Megatron command-line arguments (a string or a file holding them)")
    return import_policy(raw, source=source)


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 2**63 else repr(x)


def export_policy(policy: Policy) -> Exported:
    """Megatron command-line arguments for the policy (float32: no precision argument at all, so
    nothing to paste; listed)."""
    args: list[str] = []
    ls = policy.loss_scale
    if policy.compute_dtype == "float16":
        args.append("--fp16")
    elif policy.compute_dtype == "bfloat16":
        args.append("--bf16")
    else:
        text = "# float32: Megatron trains in float32 when neither --fp16 nor --bf16 is given\n"
        return Exported(SYSTEM, "", text, _fp32_unexpressed(policy))
    if ls.mode == "static":
        args += ["--loss-scale", _num(ls.initial)]
    elif args == ["--fp16"] and ls.mode == "dynamic":
        args += ["--initial-loss-scale", _num(ls.initial), "--min-loss-scale", repr(ls.min),
                 "--loss-scale-window", str(ls.growth_interval), "--hysteresis", str(ls.hysteresis)]
    if args[:1] == ["--fp16"] and policy.distributed.reduce_dtype == "float32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    if args[:1] == ["--bf16"] and policy.distributed.reduce_dtype == "bfloat16":
        args.append("--grad-reduce-in-bf16")
    if policy.ops.category("loss") == "lower":
        args.append("--fp16-lm-cross-entropy")
    if policy.ops.category("softmax") == "float32":
        args.append("--attention-softmax-in-fp32")
    f = policy.fp8
    if f.enabled and f.recipe in ("delayed", "tensorwise"):
        args += ["--fp8-format", "hybrid" if f.gradient_format == "e5m2" else "e4m3", "--fp8-recipe", f.recipe]
        if f.recipe == "delayed":
            args += ["--fp8-amax-history-len", str(f.amax_history), "--fp8-amax-compute-algo", "max"]
    text = " ".join(args)
    return finish(SYSTEM, policy, text, text + "\n", import_policy)


def _fp32_unexpressed(policy: Policy) -> tuple[str, ...]:
    """What a float32 Megatron run (no precision argument: every op, param and reduction in float32,
    the ``fp32`` preset) does not reproduce of ``policy``."""
    from unimp.migrate.export_check import unexpressed
    from unimp.policy.loading import load

    return unexpressed(policy, load("fp32"), SYSTEM)
