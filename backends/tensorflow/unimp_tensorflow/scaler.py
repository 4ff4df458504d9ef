"""The core loss-scale rule (:class:`unimp.loss_scale.LossScale`) as TensorFlow ops.

Pure functions of tensors, so one step traces into a ``tf.function`` with no host sync. The
scale is float32; products are taken in float64 and rounded once to float32, exactly as the
reference's ``f32(scale * factor)``.

>>> import tensorflow as tf, unimp
>>> spec = unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale
>>> st = next_state(spec, State(tf.constant(8.0), *[tf.constant(v, tf.int64) for v in (0, 1, 0, 0)]),
...                 tf.constant(True))
>>> float(st.scale), int(st.steps)
(16.0, 1)
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from unimp.spi import LossScaleSpec, f32


class State(NamedTuple):
    """Canonical loss-scale state as tensors: float32 scale, int64 counters."""

    scale: tf.Tensor
    growth_tracker: tf.Tensor
    hysteresis_left: tf.Tensor
    skipped: tf.Tensor
    steps: tf.Tensor


def _times(scale: tf.Tensor, factor: float) -> tf.Tensor:
    return tf.cast(tf.cast(scale, tf.float64) * factor, tf.float32)


def _grown(spec: LossScaleSpec, scale: tf.Tensor) -> tf.Tensor:
    new = _times(scale, spec.growth_factor)
    over = tf.cast(new, tf.float64) > spec.max
    capped = tf.where(over, tf.constant(f32(spec.max), tf.float32) if spec.on_max == "clamp" else scale, new)
    if spec.growth_requires_finite:
        return tf.where(tf.math.is_finite(new), capped, scale)
    return capped


def _after_finite(spec: LossScaleSpec, st: State) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    n = spec.growth_interval
    one = tf.constant(1, tf.int64)
    zero = tf.constant(0, tf.int64)
    if spec.growth_schedule == "interval":
        grow = st.growth_tracker + 1 >= n
        tracker = tf.where(grow, zero, st.growth_tracker + one)
    elif spec.growth_schedule == "interval_plus_one":
        grow = st.growth_tracker >= n
        tracker = tf.where(grow, zero, st.growth_tracker + one)
    else:  # window (DeepSpeed): clean steps since the last overflow
        grow = tf.logical_and(st.growth_tracker > 0, tf.math.floormod(st.growth_tracker, n) == 0)
        tracker = st.growth_tracker + one
    full = tf.constant(spec.hysteresis, tf.int64)
    hyst = full if "finite" in spec.hysteresis_refill else st.hysteresis_left
    if "growth" in spec.hysteresis_refill:
        hyst = tf.where(grow, full, hyst)
    scale = tf.where(grow, _grown(spec, st.scale), st.scale)
    return scale, tracker, hyst


def _after_nonfinite(spec: LossScaleSpec, st: State) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    absorb = st.hysteresis_left > 1
    backed = tf.maximum(_times(st.scale, spec.backoff_factor), tf.constant(f32(spec.min), tf.float32))
    full = tf.constant(spec.hysteresis, tf.int64)
    refill = full if "backoff" in spec.hysteresis_refill else st.hysteresis_left
    scale = tf.where(absorb, st.scale, backed)
    hyst = tf.where(absorb, st.hysteresis_left - 1, refill)
    return scale, tf.zeros_like(st.growth_tracker), hyst


def next_state(spec: LossScaleSpec, st: State, finite: tf.Tensor) -> State:
    """The state after one step whose gradients were (not) all finite (``finite``: scalar bool)."""
    skipped = tf.logical_and(tf.logical_not(finite), spec.skip_nonfinite)
    skipped_total = st.skipped + tf.cast(skipped, tf.int64)
    steps = st.steps + 1
    if spec.mode != "dynamic":
        return State(st.scale, st.growth_tracker, st.hysteresis_left, skipped_total, steps)
    if spec.at_min == "error":
        at_floor = tf.logical_and(st.hysteresis_left <= 1, tf.cast(st.scale, tf.float64) <= spec.min)
        tf.debugging.Assert(tf.logical_not(tf.logical_and(tf.logical_not(finite), at_floor)), [
            f"unimp: loss scale already at its minimum ({spec.min:g}) and gradients are still not "
            f"finite; set loss_scale.at_min = 'clamp' to keep training at the floor"])
    fin = _after_finite(spec, st)
    bad = _after_nonfinite(spec, st)
    scale, tracker, hyst = (tf.where(finite, a, b) for a, b in zip(fin, bad, strict=True))
    return State(scale, tracker, hyst, skipped_total, steps)


def all_finite(grads: list) -> tf.Tensor:
    """True when every gradient (dense or IndexedSlices) is finite."""
    checks = [tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
              for g in grads if g is not None]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
