"""The loss-scaling reference: one pure-Python state machine, every system's rule a knob away.

Every backend's scaler must reproduce :func:`update` exactly (scale sequence and skip decisions).
The scale is held as a float32 value, as every framework holds it on device.

>>> import unimp
>>> rule = LossScale(unimp.load({"loss_scale": {"growth_interval": 2, "initial": 8.0}}).loss_scale)
>>> [o.scale for o in rule.replay([True, True, False, True])]
[8.0, 16.0, 8.0, 8.0]
"""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from .errors import StateError
from .policy import LossScaleSpec
from .spec import FLT_MAX, INT32_MAX

STATE_KEYS = ("scale", "growth_tracker", "hysteresis_left", "skipped", "steps")


class LossScaleAtMinimumError(RuntimeError):
    """Raised when ``at_min = "error"`` and a backoff is needed at the floor (DeepSpeed's rule)."""


def f32(x: float) -> float:
    """Round to the nearest float32 (overflow gives inf)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


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
    from .spec import show

    return show(value)


def check_state(d: Any) -> list[str]:
    """Every problem of a loss-scale state (a mapping of :data:`STATE_KEYS`), each naming the key,
    the value and the fix; ``[]`` when it is usable. Bounds: the scale is a positive finite float32,
    counters are int32 (what every backend holds on device) and ``skipped <= steps``."""
    if not isinstance(d, Mapping):
        return [f"expected a mapping with keys {', '.join(STATE_KEYS)}, got {_show(d)}"]
    problems = []
    missing = [k for k in STATE_KEYS if k not in d]
    if missing:
        problems.append(f"missing keys {missing}; expected {list(STATE_KEYS)} (save it with amp.state_dict())")
    if "scale" in d:
        v = d["scale"]
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            problems.append(f"scale: expected a number, got {_show(v)}; pass a Python float")
        elif not _finite(v) or not 0 < f32(float(v)) <= FLT_MAX:
            problems.append(f"scale: {v!r} is not a positive finite float32 (between {2.0**-149:g} and "
                            f"{FLT_MAX:g}); a dynamic scale starts at loss_scale.initial, 65536.0 by default")
    counters = {}
    for key in STATE_KEYS[1:]:
        if key not in d:
            continue
        v = d[key]
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not _integral(v):
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


def _finite(v: Any) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError, OverflowError):
        return False


def _integral(v: Any) -> bool:
    return isinstance(v, numbers.Integral) or (_finite(v) and float(v).is_integer())


@dataclass(frozen=True)
class Outcome:
    """What one step did: skipped or not, and the state after the update."""

    finite: bool
    skipped: bool
    scale_before: float
    state: LossScaleState

    @property
    def scale(self) -> float:
        return self.state.scale


class LossScale:
    """The reference rule for one :class:`LossScaleSpec` (``policy.loss_scale``)."""

    def __init__(self, spec: LossScaleSpec) -> None:
        self.spec = spec

    def initial_state(self) -> LossScaleState:
        s = self.spec
        scale = 1.0 if s.mode == "none" else f32(s.initial)
        return LossScaleState(scale=scale, hysteresis_left=s.hysteresis)

    def update(self, state: LossScaleState, finite: bool) -> Outcome:
        """The state after one optimizer step whose gradients were (not) all finite."""
        s = self.spec
        skipped = (not finite) and s.skip_nonfinite
        common = {"skipped": state.skipped + int(skipped), "steps": state.steps + 1}
        if s.mode != "dynamic":
            return Outcome(finite, skipped, state.scale, replace(state, **common))
        if finite:
            new = self._finite(state)
        else:
            new = self._nonfinite(state)
        return Outcome(finite, skipped, state.scale, replace(new, **common))

    def _finite(self, st: LossScaleState) -> LossScaleState:
        s = self.spec
        n = s.growth_interval
        refill = "finite" in s.hysteresis_refill
        hyst = s.hysteresis if refill else st.hysteresis_left
        if s.growth_schedule == "interval":
            grow, tracker = st.growth_tracker + 1 >= n, st.growth_tracker + 1
            tracker = 0 if grow else tracker
        elif s.growth_schedule == "interval_plus_one":
            grow = st.growth_tracker >= n
            tracker = 0 if grow else st.growth_tracker + 1
        else:  # window (DeepSpeed): clean steps since the last overflow, not reset on growth
            grow = st.growth_tracker > 0 and st.growth_tracker % n == 0
            tracker = st.growth_tracker + 1
        scale = st.scale
        if grow:
            scale = self._grown(st.scale)
            if "growth" in s.hysteresis_refill:
                hyst = s.hysteresis
        return replace(st, scale=scale, growth_tracker=tracker, hysteresis_left=hyst)

    def _grown(self, scale: float) -> float:
        s = self.spec
        new = f32(scale * s.growth_factor)
        if new > s.max:
            return f32(s.max) if s.on_max == "clamp" else scale
        if s.growth_requires_finite and not math.isfinite(new):
            return scale
        return new

    def _nonfinite(self, st: LossScaleState) -> LossScaleState:
        s = self.spec
        if st.hysteresis_left > 1:
            return replace(st, growth_tracker=0, hysteresis_left=st.hysteresis_left - 1)
        if s.at_min == "error" and st.scale <= s.min:
            raise LossScaleAtMinimumError(
                f"loss scale already at its minimum ({s.min:g}) and gradients are still not finite; "
                f"set loss_scale.at_min = 'clamp' to keep training at the floor")
        scale = max(f32(st.scale * s.backoff_factor), f32(s.min))
        hyst = s.hysteresis if "backoff" in s.hysteresis_refill else st.hysteresis_left
        return replace(st, scale=scale, growth_tracker=0, hysteresis_left=hyst)

    def replay(self, finites: Iterable[bool], state: LossScaleState | None = None) -> Iterator[Outcome]:
        """Outcomes of a sequence of steps, from ``state`` (default: the initial state)."""
        st = state or self.initial_state()
        for finite in finites:
            out = self.update(st, bool(finite))
            st = out.state
            yield out


def trajectory(spec: LossScaleSpec, finites: Iterable[bool],
               state: LossScaleState | None = None) -> tuple[list[float], list[bool]]:
    """(scale after each step, skip decision of each step) from the reference."""
    outs = list(LossScale(spec).replay(finites, state))
    return [o.scale for o in outs], [o.skipped for o in outs]
