"""The canonical loss-scale state, the same in every backend, and the checks of a saved one.

>>> LossScaleState(scale=1024.0).to_dict()["hysteresis_left"]
1
>>> check_state({"scale": 1.0, "growth_tracker": 0, "hysteresis_left": 1, "skipped": 2, "steps": 1})
['skipped (2) is more than steps (1); a step is skipped at most once']
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from unimp.dtypes import INT32_MAX
from unimp.errors import StateError

STATE_KEYS = ("scale", "growth_tracker", "hysteresis_left", "skipped", "steps")


@dataclass(frozen=True)
class LossScaleState:
    """Canonical state, the same in every backend (plain Python numbers)."""

    scale: float
    growth_tracker: int = 0
    hysteresis_left: int = 1
    skipped: int = 0
    steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> LossScaleState:
        """Validate a whole saved state, then build it; every problem is one :class:`StateError`.

        >>> LossScaleState.from_dict({"scale": 1024.0, "growth_tracker": 3, "hysteresis_left": 1,
        ...                           "skipped": 0, "steps": 9}).scale
        1024.0
        """
        problems = check_state(d)
        if problems:
            raise StateError("loss-scale state: " + "; ".join(problems))
        return cls(scale=float(d["scale"]), **{k: int(d[k]) for k in STATE_KEYS[1:]})


def _show(value: Any) -> str:
    from unimp.policy.spec import show

    return show(value)


def check_state(d: Any) -> list[str]:
    """Every problem of a loss-scale state (a mapping of :data:`STATE_KEYS`), each naming the key,
    the value and the fix; ``[]`` when it is usable. Bounds: the scale is a finite number >= 0 (what
    a policy's held dtype makes of it is :func:`policy_problems`'), counters are int32 (what every
    backend holds on device; the rule saturates them there) and ``skipped <= steps``."""
    if not isinstance(d, Mapping):
        return [f"expected a mapping with keys {', '.join(STATE_KEYS)}, got {_show(d)}"]
    problems = []
    missing = [k for k in STATE_KEYS if k not in d]
    if missing:
        problems.append(f"missing keys {missing}; expected {list(STATE_KEYS)} (save it with amp.state_dict())")
    if "scale" in d:
        v = d["scale"]
        if not _real(v):
            problems.append(f"scale: expected a number, got {_show(v)}; pass a Python float")
        elif not _finite(v) or not (v > 0 or (v == 0 and math.copysign(1.0, v) > 0)):
            shown = repr(float(v)) if isinstance(v, float) else _show(v)
            problems.append(f"scale: {shown} is not a finite number >= 0; a dynamic scale starts at "
                            f"loss_scale.initial (by default where the framework's own scaler starts: 2^16, on Keras "
                            f"2^15)")
    counters: dict[str, int] = {}
    for key in STATE_KEYS[1:]:
        if key not in d:
            continue
        v = d[key]
        if not _real(v) or not _integral(v):
            problems.append(f"{key}: expected a whole number, got {_show(v)}; counters are integers")
        elif not 0 <= v <= INT32_MAX:
            problems.append(f"{key}: {_show(v)} is out of range; a counter is between 0 and {INT32_MAX} (int32)")
        else:
            counters[key] = int(v)
    if counters.get("hysteresis_left") == 0:
        problems.append("hysteresis_left: 0 is out of range; it is at least 1 (the steps left to absorb)")
    if "skipped" in counters and "steps" in counters and counters["skipped"] > counters["steps"]:
        problems.append(f"skipped ({counters['skipped']}) is more than steps ({counters['steps']}); a step is "
                        f"skipped at most once")
    return problems


def _real(v: Any) -> bool:
    """Whether ``v`` is a real number (any :class:`numbers.Real`: Python's, NumPy's), not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError, OverflowError):
        return False


def _integral(v: Any) -> bool:
    return isinstance(v, numbers.Integral) or (_finite(v) and float(v).is_integer())
