"""The core loss-scale rule (:func:`unimp.loss_scale.rule.step`) on TensorFlow tensors: :class:`KerasOps`
over :class:`DeviceLossScale`.

Pure functions of tensors, so one step traces into a ``tf.function`` with no host sync. The
scale is stored in float32 and computed in float64 on the float32 grid (products rounded once,
as the reference's ``f32(scale * factor)``; subnormals kept or flushed as the policy says, even
though TensorFlow's CPU kernels flush float32 subnormals). ``scale_dtype = "float64"`` cannot be
held (the Keras optimizer's scale variable is float32): :func:`unimp_keras.plan.unsupported` says
so, and :func:`next_state` refuses such a spec (the Plan's ``on_unsupported = "fallback"`` runs
``plan.loss_scale_run`` instead, the float32 rule its notes name; :func:`device_spec`).

>>> import tensorflow as tf, unimp
>>> spec = unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale
>>> st = next_state(spec, DeviceLossScale(tf.constant(8.0), *[tf.constant(v, tf.int64) for v in (0, 1, 0, 0)]),
...                 tf.constant(True))
>>> float(st.scale), int(st.steps)
(16.0, 1)
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from unimp.spi import Arrays, LossScale, LossScaleSpec, dtypes, step

from .plan import unsupported


class DeviceLossScale(NamedTuple):
    """Canonical loss-scale state as tensors: float32 scale, int64 counters."""

    scale: tf.Tensor
    growth_tracker: tf.Tensor
    hysteresis_left: tf.Tensor
    skipped: tf.Tensor
    steps: tf.Tensor


_TWO_149 = 2.0 ** 149


def decode(scale: tf.Tensor) -> tf.Tensor:
    """A float32 scale as float64, subnormals included (read from the bits: TensorFlow's CPU kernels
    treat a subnormal input as 0)."""
    bits = tf.bitcast(scale, tf.int32)
    sub = tf.equal(tf.bitwise.bitwise_and(bits, 0x7F800000), 0)
    mantissa = tf.cast(tf.bitwise.bitwise_and(bits, 0x7FFFFF), tf.float64) / _TWO_149
    return tf.where(sub, mantissa, tf.cast(scale, tf.float64))


def encode(x: tf.Tensor) -> tf.Tensor:
    """A float64 value on the float32 grid as float32, subnormals built from their bits (a cast
    would flush them to 0)."""
    sub = x < dtypes.FLT_TINY
    bits = tf.cast(tf.where(sub, x, tf.zeros_like(x)) * _TWO_149, tf.int32)
    return tf.where(sub, tf.bitcast(bits, tf.float32), tf.cast(tf.where(sub, _tiny(x), x), tf.float32))


def _tiny(x: tf.Tensor) -> tf.Tensor:
    return tf.fill(tf.shape(x), tf.constant(dtypes.FLT_TINY, x.dtype))


class KerasOps:
    """:class:`unimp.loss_scale.rule.ArrayOps` over TensorFlow tensors. The scale is computed in float64 on
    the float32 grid (products rounded once, subnormals rounded as IEEE float32 does), so the rule
    is exact even where TensorFlow flushes float32 subnormals."""

    def scalar(self, value: float) -> tf.Tensor:
        return tf.constant(value, tf.float64)

    def counter(self, value: int) -> tf.Tensor:
        return tf.constant(value, tf.int64)

    def count(self, flag: tf.Tensor) -> tf.Tensor:
        return tf.cast(flag, tf.int64)

    def mul(self, scale: tf.Tensor, factor: float) -> tf.Tensor:
        return _on_grid(scale * factor)

    def div(self, scale: tf.Tensor, divisor: float) -> tf.Tensor:
        return _on_grid(scale / divisor)  # float64 quotient of float32 values, then one float32 rounding

    where, isfinite = staticmethod(tf.where), staticmethod(tf.math.is_finite)
    logical_and, logical_not = staticmethod(tf.logical_and), staticmethod(tf.logical_not)
    maximum = staticmethod(tf.maximum)


def _on_grid(p: tf.Tensor) -> tf.Tensor:
    """A float64 value rounded to the nearest float32 (subnormals as IEEE float32 rounds them)."""
    sub = p < dtypes.FLT_TINY
    rounded_sub = tf.math.rint(tf.where(sub, p, tf.zeros_like(p)) * _TWO_149) / _TWO_149  # exact in float64
    return tf.where(sub, rounded_sub, tf.cast(tf.cast(tf.where(sub, _tiny(p), p), tf.float32), tf.float64))


def device_spec(spec: LossScaleSpec) -> LossScaleSpec:
    """The knobs that really run (``spec`` with the fallbacks :func:`unsupported` names: ``plan.loss_scale_run``)."""
    return LossScale(spec).as_run(unsupported(spec))


def runnable(spec: LossScaleSpec) -> LossScaleSpec:
    """``spec`` itself when every knob is honoured here, else :class:`UnsupportedError` naming each:
    the rule never runs a knob :func:`unsupported` declared."""
    LossScale(spec).fallbacks(unsupported(spec), "unimp_keras loss scale", "error")
    return spec


def next_state(spec: LossScaleSpec, st: DeviceLossScale, finite: tf.Tensor) -> DeviceLossScale:
    """The state after one step whose gradients were (not) all finite (``finite``: scalar bool):
    the core's rule (:func:`unimp.loss_scale.rule.step`) on tensors, no host sync; ``at_min = "error"``
    hit is a ``tf.debugging.Assert``."""
    new, error = transition(spec, st, finite)
    if error is not None:
        tf.debugging.Assert(tf.reduce_all(tf.logical_not(error)), [
            f"unimp: loss scale already at its minimum ({spec.min:g}) and gradients are still not "
            f"finite; set loss_scale.at_min = 'clamp' to keep training at the floor"])
    return new


def transition(spec: LossScaleSpec, st: DeviceLossScale, finite: tf.Tensor) -> tuple[DeviceLossScale, tf.Tensor | None]:
    """(next state, ``at_min = "error"`` flag or None) of :func:`next_state`, without the assertion."""
    spec = runnable(spec)
    if spec.mode != "dynamic":
        new, _, _ = step(KerasOps(), spec, Arrays(*st), finite)
        return DeviceLossScale(*new), None
    new, _, error = step(KerasOps(), spec, Arrays(decode(st.scale), *st[1:]), finite)
    return DeviceLossScale(encode(new.scale), *new[1:]), error


def all_finite(grads: list) -> tf.Tensor:
    """True when every gradient (dense or IndexedSlices) is finite."""
    checks = [tf.reduce_all(tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g))
              for g in grads if g is not None]
    return tf.reduce_all(tf.stack(checks)) if checks else tf.constant(True)
