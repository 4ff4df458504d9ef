"""The core's loss-scale rule as a jit-pure pytree update (no host callbacks).

:class:`LossScaleTree` is the canonical state (``scale`` float32, counters int32) plus one flag,
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

from typing import Any, NamedTuple

import numpy as np

from unimp.spi import LossScale, LossScaleAtMinimumError, LossScaleSpec, LossScaleState, UnsupportedError


class LossScaleTree(NamedTuple):
    """Canonical loss-scale state as device arrays; lives inside the optax state."""

    scale: Any  # float32 scalar
    growth_tracker: Any  # int32 scalars from here on
    hysteresis_left: Any
    skipped: Any
    steps: Any
    at_min_error: Any  # bool: at_min="error" was hit (checked on the host by :func:`check`)


def _f32_at_most(x: float) -> np.float32:
    """The largest float32 <= x (so ``v > x`` for float32 v equals ``v > _f32_at_most(x)``)."""
    v = np.float32(x)
    if np.isfinite(v) and float(v) > x:
        v = np.nextafter(v, np.float32(-np.inf))
    return v


def validate(spec: LossScaleSpec, where: str) -> None:
    """Refuse knobs the float32 device rule cannot reproduce bit for bit."""
    for key in ("growth_factor", "backoff_factor"):
        value = getattr(spec, key)
        if float(np.float32(value)) != value:
            raise UnsupportedError(
                f"{where}: loss_scale.{key} = {value!r} is not exactly representable in float32; the "
                f"JAX scaler multiplies in float32 on device and would drift from the reference rule. "
                f"fix: use a float32 value such as {float(np.float32(value))!r} or a power of two")


def initial_tree(spec: LossScaleSpec, state: LossScaleState | None = None) -> LossScaleTree:
    """Device state for ``state`` (default: the reference's initial state)."""
    import jax.numpy as jnp

    st = state or LossScale(spec).initial_state()
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return LossScaleTree(jnp.asarray(st.scale, jnp.float32), i32(st.growth_tracker),
                         i32(st.hysteresis_left), i32(st.skipped), i32(st.steps), jnp.asarray(False))


def to_state(tree: LossScaleTree) -> LossScaleState:
    """Canonical Python state (syncs with the device)."""
    return LossScaleState(scale=float(np.float32(tree.scale)), growth_tracker=int(tree.growth_tracker),
                          hysteresis_left=int(tree.hysteresis_left), skipped=int(tree.skipped),
                          steps=int(tree.steps))


def check(tree: LossScaleTree, spec: LossScaleSpec) -> None:
    """Host-side check for ``at_min = "error"``: raise the reference's error if it was hit."""
    if bool(tree.at_min_error):
        raise LossScaleAtMinimumError(
            f"loss scale already at its minimum ({spec.min:g}) and gradients are still not finite "
            f"(seen after step {int(tree.steps)}); set loss_scale.at_min = 'clamp' to keep training at "
            f"the floor")


def update_tree(spec: LossScaleSpec, t: LossScaleTree, finite: Any) -> LossScaleTree:
    """One step of :meth:`unimp.loss_scale.LossScale.update`, in float32/int32 jnp (jit-able)."""
    import jax.numpy as jnp

    if spec.mode != "dynamic" and not spec.skip_nonfinite:  # nothing but the step counter moves
        return t._replace(steps=t.steps + 1)
    finite = jnp.asarray(finite, bool)
    skipped = jnp.logical_not(finite) if spec.skip_nonfinite else jnp.asarray(False)
    if spec.mode != "dynamic":
        return t._replace(skipped=t.skipped + skipped.astype(jnp.int32), steps=t.steps + 1)
    frozen = t.at_min_error  # after an at_min error, the state no longer moves (the reference raised)
    n, hyst_full = spec.growth_interval, spec.hysteresis
    refill = spec.hysteresis_refill
    # ---- finite branch
    if spec.growth_schedule == "interval":
        grow = t.growth_tracker + 1 >= n
        f_tracker = jnp.where(grow, 0, t.growth_tracker + 1)
    elif spec.growth_schedule == "interval_plus_one":
        grow = t.growth_tracker >= n
        f_tracker = jnp.where(grow, 0, t.growth_tracker + 1)
    else:  # window
        grow = (t.growth_tracker > 0) & (t.growth_tracker % n == 0)
        f_tracker = t.growth_tracker + 1
    new = t.scale * jnp.float32(spec.growth_factor)
    grown = new
    if spec.growth_requires_finite:
        grown = jnp.where(jnp.isfinite(new), new, t.scale)
    cap = _f32_at_most(spec.max)
    over = jnp.isfinite(new) | (not spec.growth_requires_finite)
    over = over & (grown > cap)
    grown = jnp.where(over, jnp.float32(spec.max) if spec.on_max == "clamp" else t.scale, grown)
    f_scale = jnp.where(grow, grown, t.scale)
    f_hyst = jnp.full_like(t.hysteresis_left, hyst_full) if "finite" in refill else t.hysteresis_left
    if "growth" in refill:
        f_hyst = jnp.where(grow, hyst_full, f_hyst)
    # ---- non-finite branch
    absorb = t.hysteresis_left > 1
    at_floor = t.scale <= _f32_at_most(spec.min)
    error = (~absorb) & at_floor if spec.at_min == "error" else jnp.asarray(False)
    backed = jnp.maximum(t.scale * jnp.float32(spec.backoff_factor), jnp.float32(spec.min))
    n_scale = jnp.where(absorb, t.scale, backed)
    n_hyst = jnp.where(absorb, t.hysteresis_left - 1,
                       hyst_full if "backoff" in refill else t.hysteresis_left)
    # ---- select
    scale = jnp.where(finite, f_scale, n_scale)
    tracker = jnp.where(finite, f_tracker, 0)
    hyst = jnp.where(finite, f_hyst, n_hyst)
    error = error & ~finite
    keep = frozen | error
    new_t = LossScaleTree(
        scale=jnp.where(keep, t.scale, scale).astype(jnp.float32),
        growth_tracker=jnp.where(keep, t.growth_tracker, tracker).astype(jnp.int32),
        hysteresis_left=jnp.where(keep, t.hysteresis_left, hyst).astype(jnp.int32),
        skipped=jnp.where(keep, t.skipped, t.skipped + skipped.astype(jnp.int32)),
        steps=jnp.where(keep, t.steps, t.steps + 1),
        at_min_error=frozen | error,
    )
    return new_t

