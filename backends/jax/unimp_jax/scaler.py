"""The core's loss-scale rule (:func:`unimp.loss_scale.rule.step`) as a jit-pure pytree update (no host callbacks).

:class:`JaxOps` is the rule's array adapter. :class:`DeviceLossScale` is the canonical state
(``scale`` float32, or float64 under ``jax_enable_x64``; counters int32) plus one flag,
``at_min_error``, set when ``at_min = "error"`` asks for a raise inside a jitted step (which JAX
cannot do): the step is skipped, the state frozen, and :func:`check` raises on the host.

>>> import unimp, jax.numpy as jnp
>>> spec = unimp.load({"loss_scale": {"growth_interval": 2, "initial": 8.0}}).loss_scale
>>> t = initial_tree(spec)
>>> for finite in (True, True, False):
...     t = update_tree(spec, t, jnp.asarray(finite))
>>> to_state(t).scale
8.0
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from unimp.spi import (
    Arrays,
    LossScale,
    LossScaleAtMinimumError,
    LossScaleSpec,
    LossScaleState,
    StateError,
    UnsupportedError,
    dtypes,
    step,
)


class DeviceLossScale(NamedTuple):
    """Canonical loss-scale state as device arrays; lives inside the optax state."""

    scale: Any  # float32 scalar (float64 with scale_dtype = "float64" under jax_enable_x64)
    growth_tracker: Any  # int32 scalars from here on
    hysteresis_left: Any
    skipped: Any
    steps: Any
    at_min_error: Any  # bool: at_min="error" was hit (checked on the host by :func:`check`)


def _x64() -> bool:
    return bool(jax.config.jax_enable_x64)


def flushes_subnormals(dtype: str = "float32") -> bool:
    """Whether a multiply in ``dtype`` on the default device flushes a subnormal result to 0
    (measured: XLA:CPU does, float32 and float64 alike, and reads subnormal inputs as 0)."""
    return _flushes(dtype, _x64())


@functools.cache
def _flushes(dtype: str, x64: bool) -> bool:
    if dtype == "float64" and not x64:
        return False  # no float64 arrays at all: scale_dtype = "float64" is unsupported() here
    t = jnp.dtype(dtype).type
    with jax.ensure_compile_time_eval():  # may be first asked while a step is being traced
        smallest = float(np.finfo(np.dtype(dtype)).tiny)
        return float(jax.jit(lambda x: x * t(0.5))(t(smallest))) == 0.0


def unsupported(spec: LossScaleSpec) -> dict[str, tuple[Any, str]]:
    """Knobs this device cannot honour: ``{knob: (what runs instead, why)}``."""
    out: dict[str, tuple[Any, str]] = {}
    if spec.mode != "dynamic":
        return out
    if spec.scale_dtype == "float64" and not _x64():
        out["scale_dtype"] = ("float32", "JAX holds float64 only with jax_enable_x64; fix: "
                              "jax.config.update('jax_enable_x64', True) or scale_dtype = 'float32'")
    if spec.scale_dtype == "float32" and spec.subnormal == "keep" and spec.initial < dtypes.FLT_TINY \
            and flushes_subnormals():
        out["initial"] = (dtypes.FLT_TINY, "this XLA device reads a float32 scale below 2^-126 as 0; fix: initial >= "
                          "2^-126, or scale_dtype = 'float64' with jax_enable_x64")
    if not _x64():
        out.update(LossScale(spec).float32_limits(flushes=flushes_subnormals(), who="JAX (without jax_enable_x64)",
                                                  fix="jax.config.update('jax_enable_x64', True)"))
    return out


def stops_below_tiny(spec: LossScaleSpec) -> bool:
    """``subnormal = "keep"`` on a device that flushes subnormals of the held dtype, with a floor
    below its smallest normal (2^-126 in float32; 2^-1022 in float64, where 8.8e-39 is a normal
    number and runs exactly): the step that would take the scale below it is not applied, the state
    freezes, and :func:`check` raises :class:`UnsupportedError` on the host."""
    return (spec.mode == "dynamic" and spec.subnormal == "keep" and spec.min < LossScale(spec).tiny
            and flushes_subnormals(spec.scale_dtype))


def subnormal_note(spec: LossScaleSpec) -> str:
    bound = "2^-126" if spec.scale_dtype == "float32" else "2^-1022"
    return (f"loss_scale.subnormal = 'keep' cannot be honoured below {bound} here: this XLA device flushes "
            f"{spec.scale_dtype} subnormals, so a step that would take the scale below {bound} is not applied "
            f"and raises UnsupportedError on the host; fix: subnormal = 'flush', min >= {bound}"
            + (", or scale_dtype = 'float64' with jax_enable_x64" if spec.scale_dtype == "float32" else ""))


def validate(spec: LossScaleSpec, where: str, on_unsupported: str = "error") -> list[str]:
    """Refuse knobs this device cannot reproduce bit for bit (``on_unsupported = "error"``), or
    return the Plan notes saying what runs instead (``"fallback"``)."""
    notes = LossScale(spec).fallbacks(unsupported(spec), where, on_unsupported)
    run = device_spec(spec)
    return notes + ([subnormal_note(run)] if stops_below_tiny(run) else [])


def device_spec(spec: LossScaleSpec) -> LossScaleSpec:
    """The knobs that really run here (``spec`` with the fallbacks :func:`validate` reports)."""
    return LossScale(spec).as_run(unsupported(spec))


def runnable(spec: LossScaleSpec) -> LossScaleSpec:
    """``spec`` itself when this device honours every knob, else :class:`UnsupportedError` naming
    each: the scaler never runs a knob :func:`unsupported` declared (the fallback is chosen where the
    policy's ``on_unsupported`` is read: :func:`validate`, then :func:`device_spec`)."""
    LossScale(spec).fallbacks(unsupported(spec), "unimp_jax loss scale", "error")
    return spec


class JaxOps:
    """:class:`unimp.loss_scale.rule.ArrayOps` over jnp arrays (jit-pure)."""

    def __init__(self, spec: LossScaleSpec) -> None:
        self.jnp = jnp
        self.dtype = jnp.float64 if spec.scale_dtype == "float64" else jnp.float32

    def scalar(self, value: float) -> Any:
        return self.jnp.asarray(value, self.dtype)

    def counter(self, value: int) -> Any:
        return self.jnp.asarray(value, self.jnp.int32)

    def count(self, flag: Any) -> Any:
        return flag.astype(self.jnp.int32)

    def mul(self, scale: Any, factor: float) -> Any:
        jnp = self.jnp
        if _x64():  # one rounding of the float64 product
            return (scale.astype(jnp.float64) * jnp.float64(factor)).astype(self.dtype)
        return scale * jnp.float32(factor)  # exact product rounded once: factor is float32 here

    def div(self, scale: Any, divisor: float) -> Any:
        """A true division: XLA's algebraic simplifier turns ``x / constant`` into ``x * (1 / constant)``
        (openxla/xla algebraic_simplifier.cc, HandleDivide), a different rounding, so the divisor goes
        through an optimization barrier (measured exact on XLA:CPU for the scalar state; a vmapped
        batch of states is not: XLA:CPU's vectorised division is not correctly rounded)."""
        jnp = self.jnp
        if _x64():  # float64 quotient of float32 values: one rounding
            d = jax.lax.optimization_barrier(jnp.float64(divisor))
            return (scale.astype(jnp.float64) / d).astype(self.dtype)
        return scale / jax.lax.optimization_barrier(jnp.float32(divisor))

    def where(self, c: Any, a: Any, b: Any) -> Any:
        return self.jnp.where(c, a, b)

    def isfinite(self, x: Any) -> Any:
        return self.jnp.isfinite(x)

    def logical_and(self, a: Any, b: Any) -> Any:
        return self.jnp.logical_and(a, b)

    def logical_not(self, a: Any) -> Any:
        return self.jnp.logical_not(a)

    def maximum(self, a: Any, b: Any) -> Any:
        return self.jnp.maximum(a, b)


def initial_tree(spec: LossScaleSpec, state: LossScaleState | None = None) -> DeviceLossScale:
    """Device state for ``state`` (default: the reference's initial state)."""
    spec = runnable(spec)
    st = state or LossScale(spec).initial_state()
    problems = LossScale(spec).problems(st)  # the rule as it runs here (a float64 policy on float32, say)
    if problems:
        raise StateError("loss-scale state: " + "; ".join(problems))
    if spec.mode == "dynamic" and spec.subnormal == "keep" and 0 < st.scale < LossScale(spec).tiny \
            and flushes_subnormals(spec.scale_dtype):
        raise UnsupportedError(f"loss-scale state: scale = {st.scale!r} is below the smallest normal "
                               f"{spec.scale_dtype} and this XLA device reads it as 0; "
                               + subnormal_note(spec).split("; ", 1)[1])
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return DeviceLossScale(JaxOps(spec).scalar(st.scale), i32(st.growth_tracker),
                         i32(st.hysteresis_left), i32(st.skipped), i32(st.steps), jnp.asarray(False))


def to_state(tree: DeviceLossScale) -> LossScaleState:
    """Canonical Python state (syncs with the device)."""
    return LossScaleState(scale=float(np.asarray(tree.scale)), growth_tracker=int(tree.growth_tracker),
                          hysteresis_left=int(tree.hysteresis_left), skipped=int(tree.skipped),
                          steps=int(tree.steps))


def check(tree: DeviceLossScale, spec: LossScaleSpec) -> None:
    """Host-side check of a frozen state: ``at_min = "error"`` hit (the reference's error), or a
    scale that would have gone below 2^-126 on a flushing device (:func:`stops_below_tiny`)."""
    if bool(tree.at_min_error):
        if not (spec.at_min == "error" and float(np.asarray(tree.scale)) <= spec.min):
            raise UnsupportedError(f"{subnormal_note(spec)} (seen after step {int(tree.steps)})")
        raise LossScaleAtMinimumError(
            f"loss scale already at its minimum ({spec.min:g}) and gradients are still not finite "
            f"(seen after step {int(tree.steps)}); set loss_scale.at_min = 'clamp' to keep training at "
            f"the floor")


def update_tree(spec: LossScaleSpec, t: DeviceLossScale, finite: Any) -> DeviceLossScale:
    """One step of the core rule (:func:`unimp.loss_scale.rule.step`) on the device arrays (jit-able).
    After an ``at_min = "error"`` hit the state no longer moves (the reference raised)."""
    spec = runnable(spec)
    finite = jnp.asarray(finite, bool)
    new, _, error = step(JaxOps(spec), spec, Arrays(*t[:5]), finite)
    frozen = t.at_min_error if error is None else t.at_min_error | error
    if stops_below_tiny(spec):
        smallest = JaxOps(spec).scalar(LossScale(spec).tiny)
        frozen = frozen | ((new.scale < smallest) & (t.scale >= smallest))
    kept = [jnp.where(frozen, old, v).astype(old.dtype) for old, v in zip(t[:5], new, strict=True)]
    return DeviceLossScale._make([*kept, frozen])  # the five counters, then at_min_error
