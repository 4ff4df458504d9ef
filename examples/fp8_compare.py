"""What the FP8 examples share: train under an FP8 policy and under ``mixed_bf16``, print the report and
both final losses; and the check their tests run (``check``)."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main(doc: str, train: Callable[[str, int], tuple[list[float], Any]], length: str, policy: str,
         argv: list[str] | None = None) -> tuple[list[float], list[float]]:
    """``train(policy, n)`` under ``--policy`` (default ``policy``) and ``mixed_bf16``, ``n`` from ``--<length>``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(f"--{length}", type=int, default=40)
    ap.add_argument("--policy", default=policy)
    args = ap.parse_args(argv)
    n = getattr(args, length)
    fp8, amp = train(args.policy, n)
    print(amp.report(), end="\n\n")
    bf16, _ = train("mixed_bf16", n)
    print(f"final loss: {args.policy} {fp8[-1]:.4f}, mixed_bf16 {bf16[-1]:.4f} (ratio {fp8[-1] / bf16[-1]:.4f})")
    return fp8, bf16


def check(example: str, argv: list[str], recipe: str, read_output: Callable[[], str]) -> None:
    """Run ``examples/<example>.py`` with ``argv``: at least two Linear layers report ``recipe`` in the fp8
    column, and both losses fall (what the README's FP8 section promises of each example)."""
    spec = importlib.util.spec_from_file_location(example, HERE / f"{example}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fp8, bf16 = mod.main(argv)
    rows = [line.split() for line in read_output().splitlines()]
    assert sum(r[1:2] == ["linear"] and r[-1] == recipe for r in rows) >= 2
    assert fp8[-1] < fp8[0] and bf16[-1] < bf16[0]
