"""The loss-scale update rule, written once over a few array primitives.

:func:`step` is the whole rule of :class:`unimp.policy.LossScaleSpec`: growth (three schedules),
cap, finiteness check, backoff (multiply or divide), floor, hysteresis, subnormal flushing, the
``at_min`` check and the counters' bound (int32 on device: they saturate, never wrap).
It never imports a framework: it calls an :class:`ArrayOps` adapter (einops ``_backends`` style)
for the few primitives it needs, so the same rule runs on Python floats (:class:`PyOps`, the
reference of :mod:`unimp.loss_scale`), torch tensors, jit-traced JAX arrays, TensorFlow tensors...
A backend's ``scaler.py`` holds the state and one adapter; it never re-states the rule.

>>> import unimp
>>> spec = unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale
>>> st = Arrays(8.0, 0, 1, 0, 0)
>>> for finite in (True, True, False):
...     st, skipped, error = step(PyOps(spec), spec, st, finite)
>>> st.scale, skipped, error
(16.0, True, None)
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple, Protocol

from unimp.dtypes import FLT_TINY, INT32_MAX, f32
from unimp.policy import LossScaleSpec

DBL_TINY = 2.0 ** -1022  # smallest normal float64


class Arrays(NamedTuple):
    """The canonical state as the adapter's values (Python numbers, tensors, traced arrays)."""

    scale: Any
    growth_tracker: Any
    hysteresis_left: Any
    skipped: Any
    steps: Any


class ArrayOps(Protocol):
    """The primitives :func:`step` needs. ``scale`` values are in the held dtype
    (``spec.scale_dtype``); ``flag`` values are booleans; counters are integers."""

    def scalar(self, value: float) -> Any:
        """A scale-typed constant; ``value`` is exactly representable in the held dtype."""

    def counter(self, value: int) -> Any:
        """A counter-typed constant."""

    def count(self, flag: Any) -> Any:
        """1 where ``flag`` else 0, as a counter."""

    def mul(self, scale: Any, factor: float) -> Any:
        """``scale * factor`` formed exactly (or in float64) and rounded once to the held dtype,
        subnormals kept: round-to-nearest-even, overflow to inf."""

    def div(self, scale: Any, divisor: float) -> Any:
        """``scale / divisor``, correctly rounded once to the held dtype (as :meth:`mul`)."""

    def where(self, cond: Any, a: Any, b: Any) -> Any: ...
    def isfinite(self, x: Any) -> Any: ...
    def logical_and(self, a: Any, b: Any) -> Any: ...
    def logical_not(self, a: Any) -> Any: ...
    def maximum(self, a: Any, b: Any) -> Any: ...


# ---------------------------------------------------------------- rounding (plain Python)


def held(spec: LossScaleSpec, x: float) -> float:
    """``x`` rounded to the dtype the scale is held in (``spec.scale_dtype``)."""
    return f32(x) if spec.scale_dtype == "float32" else float(x)


def held_at_most(spec: LossScaleSpec, x: float) -> float:
    """The largest held value <= ``x``: for a held ``v``, ``v > x`` iff ``v > held_at_most(x)``
    (so comparisons stay exact whatever dtype a framework promotes a Python float to)."""
    v = held(spec, x)
    if v > x:
        v = math.nextafter(v, -math.inf) if spec.scale_dtype == "float64" else _f32_below(v)
    return v


def _f32_below(v: float) -> float:
    bits = struct.unpack("<i", struct.pack("<f", v))[0]
    return struct.unpack("<f", struct.pack("<i", bits - 1 if v > 0 else bits + 1))[0] if v else -(2.0 ** -149)


def factor(spec: LossScaleSpec, value: float) -> float:
    """A growth/backoff factor as the rule multiplies by it (``factor_arithmetic``)."""
    return f32(value) if spec.factor_arithmetic == "float32" else float(value)


def tiny(spec: LossScaleSpec) -> float:
    """The smallest normal value of the held dtype (below it, ``subnormal = "flush"`` gives 0)."""
    return FLT_TINY if spec.scale_dtype == "float32" else DBL_TINY


# ---------------------------------------------------------------- the rule


def step(ops: ArrayOps, spec: LossScaleSpec, st: Arrays, finite: Any) -> tuple[Arrays, Any, Any]:
    """One optimizer step of the rule: ``(new state, skipped flag, at_min error flag)``.

    ``finite``: whether every gradient of the step was finite. A flag is None where the spec rules
    it out (no skipping, no ``at_min = "error"``). When the error flag is set
    (``at_min = "error"`` and a backoff is needed at the floor) the reference raises and the
    state must not advance: the adapter decides how (raise, host check, frozen state).
    """
    steps = _inc(ops, st.steps)
    skip = ops.logical_not(finite) if spec.skip_nonfinite else None
    skipped = _inc(ops, st.skipped, skip) if skip is not None else st.skipped
    no_error = None
    if spec.mode != "dynamic":
        return st._replace(skipped=skipped, steps=steps), skip, no_error
    scale, tracker, hyst = st.scale, st.growth_tracker, st.hysteresis_left
    full, zero = ops.counter(spec.hysteresis), ops.counter(0)
    n = spec.growth_interval
    # ---- a finite step
    # tracker + 1 is only taken below the bound: no int32 counter ever wraps (a tracker past the
    # interval, which a load refuses, would grow on the next finite step, as tracker + 1 >= n says)
    if spec.growth_schedule == "interval":
        grow = tracker >= n - 1
        tracker_ok = ops.where(grow, zero, tracker + 1)
    elif spec.growth_schedule == "interval_plus_one":  # Flax
        grow = tracker >= n
        tracker_ok = ops.where(grow, zero, tracker + 1)
    else:  # window (DeepSpeed): clean steps since the last overflow, not reset on growth; at the int32
        # bound it continues from its residue (tracker % n + 1): the same growth steps as DeepSpeed's
        # unbounded Python int
        grow = ops.logical_and(tracker > 0, tracker % n == 0)
        tracker_ok = ops.where(tracker < ops.counter(INT32_MAX), tracker + 1, tracker % n + 1)
    new = _product(ops, spec, scale, spec.growth_factor)
    over = new > ops.scalar(held_at_most(spec, spec.max))  # inf > any finite cap: clamp wins (on_max)
    kept = ops.where(ops.isfinite(new), new, scale) if spec.growth_requires_finite else new
    grown = ops.where(over, ops.scalar(held(spec, spec.max)) if spec.on_max == "clamp" else scale, kept)
    scale_ok = ops.where(grow, grown, scale)
    hyst_ok = full if "finite" in spec.hysteresis_refill else hyst
    if "growth" in spec.hysteresis_refill:
        hyst_ok = ops.where(grow, full, hyst_ok)
    # ---- a non-finite step
    absorb = hyst > 1
    floor = ops.scalar(held(spec, spec.min))
    backed = ops.maximum(_product(ops, spec, scale, spec.backoff_factor, divide=spec.backoff == "divide"), floor)
    scale_bad = ops.where(absorb, scale, backed)
    hyst_bad = ops.where(absorb, hyst - 1, full if "backoff" in spec.hysteresis_refill else hyst)
    error = no_error
    if spec.at_min == "error":
        at_floor = scale <= ops.scalar(held_at_most(spec, spec.min))
        error = ops.logical_and(ops.logical_not(finite), ops.logical_and(ops.logical_not(absorb), at_floor))
    new_st = Arrays(ops.where(finite, scale_ok, scale_bad), ops.where(finite, tracker_ok, zero),
                    ops.where(finite, hyst_ok, hyst_bad), skipped, steps)
    return new_st, skip, error


def _inc(ops: ArrayOps, counter: Any, flag: Any = True) -> Any:
    """``counter + 1`` (where ``flag``), saturating at the int32 bound every device holds counters in
    (``steps`` and ``skipped`` stay at 2**31 - 1 rather than wrap to -2**31)."""
    room = counter < ops.counter(INT32_MAX)
    return counter + ops.count(room if flag is True else ops.logical_and(flag, room))


def _product(ops: ArrayOps, spec: LossScaleSpec, scale: Any, value: float, divide: bool = False) -> Any:
    """``scale * factor`` (``divide``: ``scale / growth_factor``, jmp's backoff) in the held dtype,
    flushed to 0 below its smallest normal when asked."""
    p = ops.div(scale, factor(spec, spec.growth_factor)) if divide else ops.mul(scale, factor(spec, value))
    if spec.subnormal == "flush":
        p = ops.where(p < ops.scalar(tiny(spec)), ops.scalar(0.0), p)
    return p


# ---------------------------------------------------------------- the Python adapter


class PyOps:
    """:class:`ArrayOps` over Python floats/ints/bools: the reference (exact IEEE rounding of
    ``spec.scale_dtype``, subnormals kept, as :func:`f32` does)."""

    def __init__(self, spec: LossScaleSpec) -> None:
        self.spec = spec

    def scalar(self, value: float) -> float:
        return float(value)

    def counter(self, value: int) -> int:
        return int(value)

    def count(self, flag: bool) -> int:
        return int(bool(flag))

    def mul(self, scale: float, factor: float) -> float:
        return held(self.spec, scale * factor)

    def div(self, scale: float, divisor: float) -> float:
        return held(self.spec, scale / divisor)  # float64 quotient of float32 values: one rounding to float32

    def where(self, cond: bool, a: Any, b: Any) -> Any:
        return a if cond else b

    def isfinite(self, x: float) -> bool:
        return math.isfinite(x)

    def logical_and(self, a: bool, b: bool) -> bool:
        return bool(a) and bool(b)

    def logical_not(self, a: bool) -> bool:
        return not a

    def maximum(self, a: float, b: float) -> float:
        return a if a >= b or math.isnan(a) else b
