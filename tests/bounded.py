"""The bounded-work contract in one place: every policy input is answered in < 1 s and < 200 MB.

``answer(fn, *args)`` runs ``fn`` twice: once timed (CPU seconds, robust to a busy machine, plus a
wall-clock guard against hangs), once under :mod:`tracemalloc` for its peak memory. It returns
what ``fn`` returned or raised, after asserting both bounds.
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import unimp

SECONDS = 1.0  # CPU seconds per answer
WALL_SECONDS = 10.0  # a hang, whatever the machine's load
MEGABYTES = 200


def answer(fn: Callable[..., Any], *args: Any, seconds: float = SECONDS, megabytes: float = MEGABYTES,
           **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``'s result, or the exception it raised, checked against the bounds."""
    def once() -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            return e

    wall, cpu = time.perf_counter(), time.process_time()
    out = once()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert cpu < seconds and wall < WALL_SECONDS, f"{fn.__name__} took {cpu:.2f} s CPU ({wall:.2f} s wall)"
    tracemalloc.start()
    try:
        once()
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert peak < megabytes, f"{fn.__name__} peaked at {peak:.0f} MB"
    return out


def loaded_or_refused(source: Any, **kwargs: Any) -> Any:
    """``unimp.load(source)`` within the bounds; a Policy, or the PolicyError (nothing else may escape)."""
    out = answer(unimp.load, source, **kwargs)
    assert isinstance(out, unimp.Policy | unimp.PolicyError), f"{type(out).__name__}: {out}"
    return out


def refused(source: Any, match: str = "", **kwargs: Any) -> unimp.PolicyError:
    """``unimp.load(source)`` refused within the bounds with a PolicyError whose text contains ``match``."""
    out = loaded_or_refused(source, **kwargs)
    assert isinstance(out, unimp.PolicyError), f"accepted: {out.name}"
    assert match in str(out), str(out)
    return out
