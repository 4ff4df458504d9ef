"""The loss-scaling reference: one pure-Python state machine, every system's rule a knob away.

The rule itself is :func:`unimp.loss_scale.rule.step`, written once; this module runs it on Python
numbers (the oracle every backend's scaler must reproduce exactly: scale sequence and skip
decisions) and owns the canonical state. The scale is held in ``loss_scale.scale_dtype``
(float32 like a framework's device tensor, or float64 like DeepSpeed's and apex's Python float).

>>> import unimp
>>> rule = LossScale(unimp.load({"loss_scale": {"growth_interval": 2, "initial": 8.0}}).loss_scale)
>>> [o.scale for o in rule.replay([True, True, False, True])]
[8.0, 16.0, 8.0, 8.0]
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from unimp.dtypes import FLT_TINY
from unimp.errors import StateError, UnsupportedError
from unimp.loss_scale.rule import Arrays, PyOps, f32, held, step, tiny
from unimp.policy import LossScaleSpec
from unimp.policy.spec import FLT_MAX, INT32_MAX

STATE_KEYS = ("scale", "growth_tracker", "hysteresis_left", "skipped", "steps")


class LossScaleAtMinimumError(RuntimeError):
    """Raised when ``at_min = "error"`` and a backoff is needed at the floor (DeepSpeed's rule)."""


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
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            problems.append(f"scale: expected a number, got {_show(v)}; pass a Python float")
        elif not _finite(v) or not (v > 0 or (v == 0 and math.copysign(1.0, v) > 0)):
            shown = repr(float(v)) if isinstance(v, float) else _show(v)
            problems.append(f"scale: {shown} is not a finite number >= 0; a dynamic scale starts at "
                            f"loss_scale.initial, 65536.0 by default")
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


def max_growth_tracker(spec: LossScaleSpec) -> int:
    """The largest ``growth_tracker`` the rule of ``spec`` produces: ``growth_interval - 1`` (it grows and
    resets on reaching the interval), ``growth_interval`` for Flax's ``interval_plus_one``, the int32
    bound for DeepSpeed's ``window`` (never reset on growth), 0 when the scale is not dynamic.

    >>> import unimp
    >>> max_growth_tracker(unimp.load({"loss_scale": {"growth_interval": 3}}).loss_scale)
    2
    """
    if spec.mode != "dynamic":
        return 0
    return {"interval": spec.growth_interval - 1, "interval_plus_one": spec.growth_interval}.get(
        spec.growth_schedule, INT32_MAX)


def policy_problems(spec: LossScaleSpec, st: LossScaleState) -> list[str]:
    """What in a well-formed state (:func:`check_state`) the rule of ``spec`` cannot hold or never
    produces, each naming the key and the fix; ``[]`` when :meth:`LossScale.update` runs from it.
    Every Amp checks this on load, ``strict`` or not (``strict`` is about the saved fingerprint).

    >>> import unimp
    >>> policy_problems(unimp.load("mixed_fp16").loss_scale, LossScaleState(scale=1e39))
    ['scale: 1e+39 is above the largest float32 (3.40282e+38), the dtype loss_scale.scale_dtype holds it in']
    """
    out = []
    fixed = LossScale(spec).initial_state().scale
    if spec.mode != "dynamic":
        if st.scale != fixed:
            out.append(f"scale: {st.scale!r}, but loss_scale.mode = {spec.mode!r} keeps the scale at {fixed!r}")
    elif spec.scale_dtype == "float32" and f32(st.scale) > FLT_MAX:
        out.append(f"scale: {st.scale:g} is above the largest float32 ({FLT_MAX:g}), the dtype "
                   f"loss_scale.scale_dtype holds it in")
    elif spec.subnormal == "flush" and 0 < held(spec, st.scale) < tiny(spec) and st.scale != held(spec, spec.min):
        out.append(f"scale: {st.scale!r} is below the smallest normal {spec.scale_dtype}, which "
                   f"loss_scale.subnormal = 'flush' never holds (a flushing system reads it as 0); load a "
                   f"state saved under this policy or set subnormal = 'keep'")
    elif held(spec, st.scale) == 0 and held(spec, spec.min) > 0:
        out.append(f"scale: {st.scale!r} is 0 in {spec.scale_dtype}, below loss_scale.min ({spec.min:g}); only a "
                   f"policy with min = 0 backs off to 0")
    if st.hysteresis_left > spec.hysteresis:
        out.append(f"hysteresis_left: {st.hysteresis_left} is above loss_scale.hysteresis ({spec.hysteresis})")
    top = max_growth_tracker(spec)
    if st.growth_tracker > top:
        why = (f"loss_scale.mode = {spec.mode!r} never counts toward growth" if spec.mode != "dynamic" else
               f"loss_scale.growth_schedule = {spec.growth_schedule!r} with growth_interval = "
               f"{spec.growth_interval} grows the scale and resets the count before it gets there")
        out.append(f"growth_tracker: {st.growth_tracker} is out of range 0 to {top}: {why}; load a state saved "
                   f"under this policy")
    return out


def loss_scale_fallbacks(spec: LossScaleSpec, unsupported: Mapping[str, tuple[str, str]], where: str,
                         on_unsupported: str) -> list[str]:
    """Apply ``on_unsupported`` to the loss-scale knobs a backend cannot honour (``unsupported``:
    ``{knob: (what runs instead, why)}``): an :class:`UnsupportedError` naming each (``"error"``),
    else the Plan notes saying what runs instead.

    >>> import dataclasses, unimp
    >>> spec = dataclasses.replace(unimp.load("mixed_fp16").loss_scale, scale_dtype="float64")
    >>> loss_scale_fallbacks(spec, {"scale_dtype": ("float32", "no float64")}, "policy 'p'", "fallback")
    ["loss_scale.scale_dtype = 'float64' runs as 'float32': no float64"]
    """
    if unsupported and on_unsupported == "error":
        raise UnsupportedError(f"{where}: " + "; ".join(
            f"loss_scale.{k} = {getattr(spec, k)!r} cannot be honoured: {why}" for k, (_, why) in unsupported.items())
            + " (or on_unsupported = 'fallback')")
    return [f"loss_scale.{k} = {getattr(spec, k)!r} runs as {v!r}: {why}" for k, (v, why) in unsupported.items()]


def loss_scale_as_run(spec: LossScaleSpec, unsupported: Mapping[str, tuple[str, str]]) -> LossScaleSpec:
    """``spec`` with each knob a backend cannot honour set to what it runs instead."""
    return dataclasses.replace(spec, **{k: v for k, (v, _) in unsupported.items()})


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
        self._ops = PyOps(spec)

    def held(self, x: float) -> float:
        """``x`` rounded to the dtype the scale is held in (``loss_scale.scale_dtype``)."""
        return held(self.spec, x)

    @property
    def tiny(self) -> float:
        """The smallest normal value of the held dtype (below it ``subnormal = "flush"`` gives 0)."""
        return tiny(self.spec)

    def fallbacks(self, unsupported: Mapping[str, tuple[str, str]], where: str, on_unsupported: str) -> list[str]:
        """The knobs a backend cannot honour refused or noted (:func:`loss_scale_fallbacks`)."""
        return loss_scale_fallbacks(self.spec, unsupported, where, on_unsupported)

    def as_run(self, unsupported: Mapping[str, tuple[str, str]]) -> LossScaleSpec:
        """The spec with each knob a backend cannot honour set to what runs instead."""
        return loss_scale_as_run(self.spec, unsupported)

    def float32_limits(self, *, flushes: bool, who: str, fix: str) -> dict[str, tuple[str, str]]:
        """The knobs a device running the rule's factors in float32 cannot honour (an XLA device without
        ``jax_enable_x64``): ``{knob: (what runs instead, why)}`` for a backoff factor below 2^-126 where the
        device ``flushes`` float32 subnormals (it reads as 0), and factors not exact in float32 under
        ``factor_arithmetic = "float64"``. ``who`` names what multiplies ("JAX", "Keras on JAX"); ``fix``: the
        way to float64 arithmetic there.

        >>> from unimp.policy.loading import load
        >>> spec = load({"loss_scale": {"growth_factor": 1.1, "factor_arithmetic": "float64"}}).loss_scale
        >>> LossScale(spec).float32_limits(flushes=True, who="JAX", fix="enable x64")["factor_arithmetic"][0]
        'float32'
        """
        spec, out = self.spec, {}
        if spec.backoff == "multiply" and 0 < f32(spec.backoff_factor) < FLT_TINY and flushes:
            out["backoff_factor"] = (0.0, f"the factor is a float32 below 2^-126 in {who}, which this device "
                                          f"reads as 0; fix: {fix} or backoff_factor >= 2^-126")
        if spec.factor_arithmetic == "float64":
            used = ("growth_factor", "backoff_factor") if spec.backoff == "multiply" else ("growth_factor",)
            for key in used:
                value = getattr(spec, key)
                if f32(value) != value:
                    out["factor_arithmetic"] = ("float32", (
                        f"loss_scale.{key} = {value!r} is not exactly representable in float32 and {who} "
                        f"multiplies in float32; fix: a float32 value such as {f32(value)!r} or a power of two, "
                        f"factor_arithmetic = 'float32', or {fix}"))
        return out

    def problems(self, state: LossScaleState) -> list[str]:
        """What in a well-formed ``state`` this rule cannot hold or never produces (:func:`policy_problems`)."""
        return policy_problems(self.spec, state)

    def initial_state(self) -> LossScaleState:
        s = self.spec
        scale = 1.0 if s.mode == "none" else held(s, s.initial)
        return LossScaleState(scale=scale, hysteresis_left=s.hysteresis)

    def update(self, state: LossScaleState, finite: bool) -> Outcome:
        """The state after one optimizer step whose gradients were (not) all finite
        (:func:`unimp.loss_scale.rule.step` on Python numbers)."""
        s = self.spec
        st, skipped, error = step(self._ops, s, Arrays(*(getattr(state, k) for k in STATE_KEYS)), bool(finite))
        if error:
            raise LossScaleAtMinimumError(
                f"loss scale already at its minimum ({s.min:g}) and gradients are still not finite; "
                f"set loss_scale.at_min = 'clamp' to keep training at the floor")
        return Outcome(bool(finite), bool(skipped), state.scale, LossScaleState(*st))

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
