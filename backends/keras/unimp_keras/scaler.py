"""The core loss-scale rule (:func:`unimp.loss_scale.rule.step`) on Keras tensors: :class:`KerasOps`
(``keras.ops``) over :class:`DeviceLossScale`, traceable: the float32 scale computed in float64 on the float32 grid
where the Keras backend has float64 (JAX: under ``jax_enable_x64``); what a Keras backend cannot hold is declared
in the Plan (:func:`unimp_keras.plan.unsupported`) and refused by :func:`next_state`.

>>> import keras, unimp
>>> spec = unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale
>>> st = next_state(spec, initial(spec), keras.ops.convert_to_tensor(True))
>>> to_state(st).scale, to_state(st).steps
(16.0, 1)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import numpy as np
from keras import ops

from unimp.spi import Arrays, LossScale, LossScaleAtMinimumError, LossScaleSpec, LossScaleState, dtypes, step

from .plan import unsupported

COUNTER = "int32"  # counters are int32 on every device; the rule saturates them at the bound
_TWO_149 = 2.0 ** 149


class DeviceLossScale(NamedTuple):
    """Canonical loss-scale state as Keras tensors: float32 scale, int32 counters."""

    scale: Any
    growth_tracker: Any
    hysteresis_left: Any
    skipped: Any
    steps: Any


def wide() -> str:
    """The dtype the rule computes the scale in on this Keras backend: float64 where it has one."""
    if keras.backend.backend() == "jax":
        import jax

        return "float64" if jax.config.jax_enable_x64 else "float32"
    return "float64"


def held(value: float) -> Any:
    """A scale as the float32 tensor the state holds; its bits are kept (no kernel runs on it)."""
    return ops.convert_to_tensor(np.float32(dtypes.f32(value)))


def decode(scale: Any) -> Any:
    """The held float32 scale in :func:`wide`, subnormals included."""
    if keras.backend.backend() == "tensorflow":
        from . import tf_scale

        return tf_scale.decode(scale)
    return ops.cast(scale, wide())


def encode(x: Any) -> Any:
    """A :func:`wide` value on the float32 grid as the held float32."""
    if keras.backend.backend() == "tensorflow":
        from . import tf_scale

        return tf_scale.encode(x)
    return ops.cast(x, "float32")


def _barrier(x: Any) -> Any:
    """Keep XLA from turning ``x / constant`` into ``x * (1 / constant)`` (another rounding)."""
    if keras.backend.backend() == "jax":
        import jax

        return jax.lax.optimization_barrier(x)
    return x


def _on_grid(p: Any) -> Any:
    """A float64 value rounded to the nearest float32 (subnormals as IEEE float32 rounds them)."""
    sub = p < dtypes.FLT_TINY
    rounded_sub = ops.round(ops.where(sub, p, ops.zeros_like(p)) * _TWO_149) / _TWO_149  # exact in float64
    normal = ops.cast(ops.cast(ops.where(sub, ops.full_like(p, dtypes.FLT_TINY), p), "float32"), "float64")
    return ops.where(sub, rounded_sub, normal)


class KerasOps:
    """:class:`unimp.loss_scale.rule.ArrayOps` over Keras tensors (``keras.ops``), the scale in :func:`wide`."""

    def __init__(self) -> None:
        self.dtype = wide()

    def scalar(self, value: float) -> Any:
        return ops.convert_to_tensor(value, self.dtype)

    def counter(self, value: int) -> Any:
        return ops.convert_to_tensor(value, COUNTER)

    def count(self, flag: Any) -> Any:
        return ops.cast(flag, COUNTER)

    def mul(self, scale: Any, factor: float) -> Any:
        p = scale * ops.convert_to_tensor(factor, self.dtype)
        return _on_grid(p) if self.dtype == "float64" else p

    def div(self, scale: Any, divisor: float) -> Any:
        q = scale / _barrier(ops.convert_to_tensor(divisor, self.dtype))
        return _on_grid(q) if self.dtype == "float64" else q

    where, isfinite = staticmethod(ops.where), staticmethod(ops.isfinite)
    logical_and, logical_not = staticmethod(ops.logical_and), staticmethod(ops.logical_not)
    maximum = staticmethod(ops.maximum)


def device_spec(spec: LossScaleSpec) -> LossScaleSpec:
    """The knobs that really run (``spec`` with the fallbacks :func:`unsupported` names: ``plan.loss_scale``)."""
    return LossScale(spec).as_run(unsupported(spec))


def runnable(spec: LossScaleSpec) -> LossScaleSpec:
    """``spec`` itself when every knob is honoured here, else :class:`UnsupportedError` naming each."""
    LossScale(spec).fallbacks(unsupported(spec), "unimp_keras loss scale", "error")
    return spec


def initial(spec: LossScaleSpec, state: LossScaleState | None = None) -> DeviceLossScale:
    """The state (default: the spec's initial one) as Keras tensors."""
    st = state or LossScale(spec).initial_state()
    counters = (st.growth_tracker, st.hysteresis_left, st.skipped, st.steps)
    return DeviceLossScale(held(st.scale), *(ops.convert_to_tensor(v, COUNTER) for v in counters))


def to_state(st: DeviceLossScale) -> LossScaleState:
    """Plain Python numbers (a host read)."""
    values = [np.asarray(ops.convert_to_numpy(v)) for v in st]
    return LossScaleState(float(values[0]), *(int(v) for v in values[1:]))


AT_MIN = ("unimp: loss scale already at its minimum ({min:g}) and gradients are still not finite; set "
          "loss_scale.at_min = 'clamp' to keep training at the floor")


def next_state(spec: LossScaleSpec, st: DeviceLossScale, finite: Any) -> DeviceLossScale:
    """The state after one step whose gradients were (not) all ``finite``; an ``at_min = "error"`` hit raises
    (:class:`LossScaleAtMinimumError`; on TensorFlow a ``tf.debugging.Assert``)."""
    new, error = transition(spec, st, finite)
    if error is not None:
        message = AT_MIN.format(min=spec.min)
        if keras.backend.backend() == "tensorflow":
            from .tf_scale import assert_not

            assert_not(error, message)
        elif bool(ops.convert_to_numpy(ops.any(error))):
            raise LossScaleAtMinimumError(message)
    return new


def transition(spec: LossScaleSpec, st: DeviceLossScale, finite: Any) -> tuple[DeviceLossScale, Any]:
    """(next state, ``at_min = "error"`` flag or None) of :func:`next_state`, without the check."""
    spec = runnable(spec)
    counters = [ops.cast(c, COUNTER) for c in st[1:]]
    if spec.mode != "dynamic":
        new, _, _ = step(KerasOps(), spec, Arrays(st.scale, *counters), finite)
        return DeviceLossScale(*new), None
    new, _, error = step(KerasOps(), spec, Arrays(decode(st.scale), *counters), finite)
    return DeviceLossScale(encode(new.scale), *new[1:]), error


def _dense(g: Any) -> Any:
    """A gradient as a dense tensor's values (TensorFlow's ``IndexedSlices``: their values)."""
    return g.values if type(g).__name__ == "IndexedSlices" else g


def all_finite(grads: list) -> Any:
    """True when every gradient (dense or TensorFlow IndexedSlices) is finite."""
    checks = [ops.all(ops.isfinite(_dense(g))) for g in grads if g is not None]
    return ops.all(ops.stack(checks)) if checks else ops.convert_to_tensor(True)
