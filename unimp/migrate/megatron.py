"""Megatron-LM: the precision arguments of ``pretrain_gpt.py`` & co., both directions.

Read from megatron/training/arguments.py and megatron/core/optimizer (grad_scaler.py,
``get_megatron_optimizer``): ``--fp16`` float16 params with float32 main params and
``DynamicGradScaler(initial_scale=--initial-loss-scale 2**32, min_scale=--min-loss-scale 1.0,
growth_factor 2.0, backoff_factor 0.5, growth_interval=--loss-scale-window 1000,
hysteresis=--hysteresis 2)``, or ``ConstantGradScaler(--loss-scale)`` when given; ``--bf16``
bfloat16 params with float32 main params, no scaler unless ``--loss-scale``; gradients are
reduced in the params' dtype unless ``--accumulate-allreduce-grads-in-fp32`` (implied by
``--bf16``). Other arguments are not precision settings: ignored and listed in the header.

>>> imp = import_policy("--fp16 --loss-scale-window 500 --hysteresis 3 --micro-batch-size 4")
>>> imp.policy.loss_scale.growth_interval, imp.policy.loss_scale.hysteresis, imp.ignored
(500, 3, ('--micro-batch-size',))
>>> export_policy(imp.policy).config
'--fp16 --initial-loss-scale 4294967296 --min-loss-scale 1.0 --loss-scale-window 500 --hysteresis 3'
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from ..policy import Policy
from .common import Draft, Exported, Imported, bad, finish, has_knob, number

SYSTEM = "megatron"
FLAGS = ("--fp16", "--bf16", "--accumulate-allreduce-grads-in-fp32")
VALUED = {"--loss-scale": float, "--initial-loss-scale": float, "--min-loss-scale": float,
          "--loss-scale-window": int, "--hysteresis": int}


def parse_args(args: str | Sequence[str], source: str = "megatron") -> tuple[dict[str, Any], list[str]]:
    """(precision arguments, other argument names) of a Megatron command line."""
    if isinstance(args, str):
        try:
            words = shlex.split(args.replace("\\\n", " "), comments=True)
        except ValueError as e:
            raise bad(source, "", f"cannot split the command line ({e})") from None
    else:
        words = list(args)
    got: dict[str, Any] = {}
    other: list[str] = []
    i = 0
    while i < len(words):
        word, value = words[i], None
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
            try:
                got[word] = VALUED[word](float(value)) if VALUED[word] is int and float(value).is_integer() \
                    else VALUED[word](value)
            except ValueError:
                raise bad(source, word, f"{value!r} is not a number") from None
        elif word.startswith("--"):
            other.append(word)
        i += 1
    return got, other


def import_policy(args: str | Sequence[str], *, source: str = "megatron") -> Imported:
    """The policy of a Megatron-LM run with these command-line arguments."""
    got, other = parse_args(args, source)
    if not got and not other:  # nothing Megatron reads: a wrong file or string, not a float32 run
        raise bad(source, "", "no Megatron argument found (they start with --); pass the command line, e.g. "
                              "'--fp16 --loss-scale-window 1000' (a float32 run: any of its arguments)")
    if got.get("--fp16") and got.get("--bf16"):
        raise bad(source, "--bf16", "--fp16 and --bf16 together (Megatron refuses this); keep one")
    static = got.get("--loss-scale")
    if got.get("--fp16"):
        d = Draft(SYSTEM, source, "megatron_fp16", "--fp16: float16 params, float32 main params, DynamicGradScaler")
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
        reduce = "float32" if got.get("--accumulate-allreduce-grads-in-fp32") else "float16"
        d.set("distributed.reduce_dtype", reduce, "--accumulate-allreduce-grads-in-fp32" if reduce == "float32"
              else "gradients reduced in the params' dtype (no --accumulate-allreduce-grads-in-fp32)")
    elif got.get("--bf16"):
        d = Draft(SYSTEM, source, "pure_bf16", "--bf16: bfloat16 params, float32 main params")
        d.set("distributed.reduce_dtype", "float32", "--bf16 implies --accumulate-allreduce-grads-in-fp32")
    else:
        d = Draft(SYSTEM, source, "fp32", "neither --fp16 nor --bf16: float32")
    if static is not None:
        if not (got.get("--fp16") or got.get("--bf16")):
            d.note("--loss-scale without --fp16/--bf16 is unused by Megatron", warn=True)
        else:
            d.set("loss_scale.mode", "static", "--loss-scale: ConstantGradScaler")
            d.set("loss_scale.initial", number(source, "--loss-scale", static), "--loss-scale")
    d.ignored.extend(other)
    return d.build()


def from_cli(raw: Any, source: str) -> Imported:
    if not isinstance(raw, str | list):
        raise bad(source, "", "expected Megatron command-line arguments (a string or a file holding them)")
    return import_policy(raw, source=source)


def _num(x: float) -> str:
    return str(int(x)) if x.is_integer() and abs(x) < 2**63 else repr(x)


def export_policy(policy: Policy) -> Exported:
    """Megatron command-line arguments for the policy."""
    args: list[str] = []
    ls = policy.loss_scale
    if policy.compute_dtype == "float16":
        args.append("--fp16")
    elif policy.compute_dtype == "bfloat16":
        args.append("--bf16")
    if args and ls.mode == "static":
        args += ["--loss-scale", _num(ls.initial)]
    elif args == ["--fp16"] and ls.mode == "dynamic":
        args += ["--initial-loss-scale", _num(ls.initial), "--min-loss-scale", repr(ls.min),
                 "--loss-scale-window", str(ls.growth_interval), "--hysteresis", str(ls.hysteresis)]
    if args[:1] == ["--fp16"] and policy.distributed.reduce_dtype == "float32":
        args.append("--accumulate-allreduce-grads-in-fp32")
    text = " ".join(args)
    return finish(SYSTEM, policy, text, text + "\n", import_policy)
