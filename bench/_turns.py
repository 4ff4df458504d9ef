"""Timing by turns, shared by the watch-overhead benches (``watch_overhead.py``, ``watch_overhead_paddle.py``):
builds take turns step by step in a rotating order, so drift of the machine reaches them alike."""

from __future__ import annotations

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
