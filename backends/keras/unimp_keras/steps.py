"""One custom training step on each Keras backend, the way it differentiates (what the conformance kit and the
tests drive): TensorFlow ``tf.GradientTape`` (in a ``tf.function`` for Keras float8 layers), torch ``backward``,
then ``amp.apply_gradients``; JAX jitted ``model.stateless_call`` + ``jax.grad`` -> ``stateless_apply``.

>>> import keras, numpy as np, unimp
>>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="fc")])
>>> amp = unimp.apply("mixed_fp16", m, keras.optimizers.SGD(0.1))
>>> mse = lambda out, y: keras.ops.mean(keras.ops.square(keras.ops.cast(out, "float32") - y))
>>> _ = custom_step(amp, mse, np.ones((2, 4), "float32"), np.zeros((2, 2), "float32"))
>>> amp.loss_scale_state().steps
1
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

Loss = Callable[[Any, Any], Any]
_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Amp -> its jitted JAX step


def custom_step(amp: Any, loss_fn: Loss, x: Any, y: Any, poison: bool = False) -> float:
    """One step of ``amp`` on ``(x, y)``: scale the loss, differentiate, unscale / skip / step; ``poison``
    multiplies the loss by inf (every gradient non-finite). Returns the unscaled loss."""
    name, model = keras.backend.backend(), amp.model
    if name == "jax":
        return _jax_step(amp, loss_fn, x, y, poison)
    if name == "torch":
        y = ops.convert_to_tensor(y)

    def step(x: Any, y: Any, poison: Any) -> Any:
        return _scaled_step(amp, model.trainable_variables, lambda: loss_fn(model(x, training=True), y), poison)

    if name == "tensorflow" and getattr(amp, "_binding", None) is not None and amp._binding.fp8:
        import tensorflow as tf

        fn = _JITTED.setdefault(amp, tf.function(step))
        return float(fn(tf.constant(x), tf.constant(y), tf.constant(poison)))
    return float(ops.convert_to_numpy(step(x, y, poison)))


def optimizer_step(opt: Any, variables: list, loss_fn: Callable[[], Any]) -> Callable[[bool], None]:
    """``step(poison)``: one scaled step of ``opt`` (unimp's or Keras' loss-scaling optimizer) on bare ``variables``
    (``loss_fn()`` reads them), each Keras backend's way (TensorFlow: in a ``tf.function``).

    >>> import keras, numpy as np
    >>> w = keras.Variable(np.ones(2, np.float32))
    >>> opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    >>> step = optimizer_step(opt, [w], lambda: keras.ops.sum(w * w))
    >>> step(True); float(opt.dynamic_scale.numpy()), step(False), float(opt.dynamic_scale.numpy())
    (4.0, None, 4.0)
    """
    name = keras.backend.backend()
    if name != "jax":
        def step(poison: Any) -> None:
            _scaled_step(opt, variables, loss_fn, poison)

        if name == "torch":
            return step
        import tensorflow as tf

        compiled = tf.function(step)
        return lambda poison: compiled(tf.constant(poison))
    import jax

    def pure(tv: list, ov: list, poison: Any) -> Any:
        def scaled_of(tv: list) -> Any:
            mapping = [*zip(variables, tv, strict=True), *zip(opt.variables, ov, strict=True)]
            with keras.StatelessScope(state_mapping=mapping):
                return opt.scale_loss(loss_fn() * _factor(poison))

        return opt.stateless_apply(ov, jax.grad(scaled_of)(tv), tv)

    jitted = jax.jit(pure)

    def jax_step(poison: bool) -> None:
        if not opt.built:
            opt.build(variables)
        new_tv, new_ov = jitted([v.value for v in variables], [v.value for v in opt.variables], poison)
        _assign((variables, new_tv), (opt.variables, new_ov))

    return jax_step


def _factor(poison: Any) -> Any:
    return ops.where(poison, ops.convert_to_tensor(np.inf, "float32"), ops.convert_to_tensor(1.0, "float32"))


def _assign(*groups: tuple[list, list]) -> None:
    for variables, values in groups:
        for var, value in zip(variables, values, strict=True):
            var.assign(value)


def _scaled_step(scaler: Any, variables: list, loss_of: Callable[[], Any], poison: Any) -> Any:
    """``scaler.scale_loss(loss_of() * factor)`` differentiated over ``variables`` (TensorFlow: a GradientTape;
    torch: ``backward``), handed to ``scaler.apply_gradients``; returns the unscaled loss."""
    factor = _factor(ops.convert_to_tensor(poison))
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_of()
            scaled = scaler.scale_loss(loss * factor)
        scaler.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        return loss
    for v in variables:
        v.value.grad = None
    loss = loss_of()
    scaler.scale_loss(loss * factor).backward()
    scaler.apply_gradients([(v.value.grad, v) for v in variables])
    for v in variables:
        v.value.grad = None
    return loss


def _jax_step(amp: Any, loss_fn: Loss, x: Any, y: Any, poison: bool) -> float:
    """Keras' JAX trainer's way: ``(trainable, non-trainable, optimizer values, x, y, poison) -> (loss, new values)``
    jitted once per Amp, the new values assigned back."""
    import jax

    model, opt = amp.model, amp.optimizer
    if opt is None:
        raise ValueError("custom_step: unimp.apply was given no optimizer")
    if not opt.built:
        opt.build(model.trainable_variables)

    def pure(tv: list, ntv: list, ov: list, x: Any, y: Any, poison: Any) -> Any:
        def loss_of(tv: list) -> Any:
            out, new_ntv = model.stateless_call(tv, ntv, x, training=True)
            loss = loss_fn(out, y)
            with keras.StatelessScope(state_mapping=list(zip(opt.variables, ov, strict=True))):
                scaled = amp.scale_loss(loss * _factor(poison))
            return scaled, (loss, new_ntv)

        grads, (loss, new_ntv) = jax.grad(loss_of, has_aux=True)(tv)
        new_tv, new_ov = opt.stateless_apply(ov, grads, tv)
        return loss, new_tv, new_ntv, new_ov

    step = _JITTED.setdefault(amp, jax.jit(pure))
    groups = (model.trainable_variables, model.non_trainable_variables, opt.variables)
    loss, *values = step(*([v.value for v in g] for g in groups), x, y, poison)
    _assign(*zip(groups, values, strict=True))
    return float(loss)
