"""The loss-scaling reference: :func:`unimp.loss_scale.rule.step` run on Python numbers, the oracle every
backend's scaler must reproduce exactly (scale sequence and skip decisions), and the checks of a state
against one policy's rule.

>>> import unimp
>>> LossScale(unimp.load({"loss_scale": {"growth_interval": 2, "initial": 8.0}}).loss_scale).update(
...     LossScaleState(scale=8.0), finite=False).scale
4.0
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from unimp.dtypes import FLT_MAX, FLT_TINY, INT32_MAX, f32
from unimp.loss_scale.fallbacks import loss_scale_as_run, loss_scale_fallbacks
from unimp.loss_scale.rule import Arrays, PyOps, held, step, tiny
from unimp.loss_scale.state import STATE_KEYS, LossScaleState
from unimp.policy.tables import LossScaleSpec


class LossScaleAtMinimumError(RuntimeError):
    """Raised when ``at_min = "error"`` and a backoff is needed at the floor (DeepSpeed's rule)."""


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

    def fallbacks(self, unsupported: Mapping[str, tuple[Any, str]], where: str, on_unsupported: str) -> list[str]:
        """The knobs a backend cannot honour refused or noted (:func:`loss_scale_fallbacks`)."""
        return loss_scale_fallbacks(self.spec, unsupported, where, on_unsupported)

    def as_run(self, unsupported: Mapping[str, tuple[Any, str]]) -> LossScaleSpec:
        """The spec with each knob a backend cannot honour set to what runs instead."""
        return loss_scale_as_run(self.spec, unsupported)

    def float32_limits(self, *, flushes: bool, who: str, fix: str) -> dict[str, tuple[Any, str]]:
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
        spec = self.spec
        out: dict[str, tuple[Any, str]] = {}
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
