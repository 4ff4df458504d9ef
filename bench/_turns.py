"""Timing by turns, shared by the watch-overhead benches (``watch_overhead.py``, ``watch_overhead_paddle.py``):
builds take turns step by step in a rotating order, so drift of the machine reaches them alike."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable


def measure(steps: dict[str, Callable[[], None]], n: int, clock: Callable[[], float] = time.process_time,
            sync: Callable[[], None] = lambda: None) -> dict[str, list[float]]:
    """Per build, the time of each of ``n`` steps (ms), the builds taking turns step by step, rotating."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(n):
        for name in names[i % len(names):] + names[:i % len(names)]:
            sync()
            t = clock()
            steps[name]()
            sync()
            times[name].append((clock() - t) * 1e3)
    return times


def cost(times: list[float], sampled: set[int], every: int) -> tuple[float, float, float]:
    """(cost per step over a run of ``every`` steps, median sampled step, median other step), from medians."""
    other = statistics.median(t for i, t in enumerate(times) if i not in sampled)
    if not sampled:
        return other, other, other
    hit = statistics.median(times[i] for i in sampled)
    return (hit + (every - 1) * other) / every, hit, other


def arguments(steps: int = 300, warmup: int | None = 20) -> argparse.ArgumentParser:
    """The options of every watch-overhead bench (a bench adds its own): the timed steps per build, ``every``,
    the warm-up (``warmup=None``: a bench without the option), the model's size, ``--localize``, ``--wall``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=steps, help="timed steps per build")
    ap.add_argument("--every", type=int, default=100)
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--localize", action="store_true", help="also a build watched with localize=True")
    ap.add_argument("--wall", action="store_true", help="wall time instead of the process's CPU time")
    return ap


def header(first: str, watched: list[str]) -> str:
    """The table's two header lines: ``first`` (a label column, or "" for none), plain, plain2, A/A, per watch."""
    lead = f"| {first} " if first else ""
    return (lead + "| plain | plain2 | A/A plain2/plain | " + " | ".join(
        f"{w}: per step (sampled, other) | {w}/plain" for w in watched) + " |\n"
        + ("|---" if first else "") + "|---|---|---|" + "---|---|" * len(watched))


def line(first: str, times: dict[str, list[float]], sampled: dict[str, set[int]], every: int) -> str:
    """One table line: per build :func:`cost` of its ``times`` (``sampled``: the indexes of its sampled steps,
    empty for an unwatched build), each watched build over ``plain`` with the A/A ``plain2/plain`` beside."""
    row = {name: cost(t, sampled.get(name, set()), every) for name, t in times.items()}
    plain, plain2 = row["plain"][0], row["plain2"][0]
    cells = " | ".join(f"{row[w][0]:.3f} ({row[w][1]:.2f}, {row[w][2]:.3f}) | {row[w][0] / plain:.3f}"
                       for w in row if w not in ("plain", "plain2"))
    return (f"| {first} " if first else "") + f"| {plain:.3f} | {plain2:.3f} | {plain2 / plain:.3f} | {cells} |"


def run_builds(variant: Callable[..., Callable[[], None]], args: argparse.Namespace,
               clock: Callable[[], float] = time.process_time) -> tuple[dict[str, list[float]], dict[str, set[int]]]:
    """The builds of a watch-overhead bench from ``variant(**watch)`` (a step whose ``.amp`` is its Amp): ``plain``,
    ``plain2`` (the A/A control), ``watched`` (``every``) and, with ``--localize``, ``localize``; each warmed up
    (``args.warmup`` steps; the watch's first sampled step is the first of them), then timed by :func:`measure`.
    Returns the times and, per watched build, the indexes of its sampled timed steps (checked on its records)."""
    steps = {"plain": variant(), "plain2": variant(), "watched": variant(every=args.every)}
    if args.localize:
        steps["localize"] = variant(every=args.every, localize=True)
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times = measure(steps, args.steps, clock)
    sampled = {}
    for name, step in steps.items():
        watch = getattr(step.amp, "_watch", None)  # type: ignore[attr-defined]
        if watch is not None:
            sampled[name] = {i for i in range(args.steps) if (args.warmup + i) % args.every == 0}
            assert {r["step"] - args.warmup for r in watch.records if r["sampled"] and r["step"] >= args.warmup} \
                == sampled[name]
    return times, sampled
