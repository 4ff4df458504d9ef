"""One custom training step on each Keras backend, the way that backend differentiates
(what the conformance kit and the tests drive; the README shows the same three loops):

- TensorFlow: ``tf.GradientTape`` -> ``amp.apply_gradients`` (in a ``tf.function`` where Keras float8
  layers run: their gradient does not run eagerly);
- JAX: ``model.stateless_call`` + ``jax.grad`` -> ``optimizer.stateless_apply``, jitted, the new values
  assigned back (as Keras' JAX trainer does);
- torch: ``loss.backward()`` -> ``amp.apply_gradients``.

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
    name = keras.backend.backend()
    if name == "tensorflow":
        return _tf_step(amp, loss_fn, x, y, poison)
    if name == "jax":
        return _jax_step(amp, loss_fn, x, y, poison)
    return _torch_step(amp, loss_fn, x, y, poison)


def optimizer_step(opt: Any, variables: list, loss_fn: Callable[[], Any]) -> Callable[[bool], None]:
    """``step(poison)``: one scaled step of ``opt`` (a loss-scaling optimizer: unimp's or Keras' own) on bare
    ``variables``, ``loss_fn()`` reading them, each Keras backend's way (TensorFlow: a ``tf.function``
    GradientTape step; JAX: jitted ``jax.grad`` + ``stateless_apply``; torch: ``backward``); ``poison``
    multiplies the loss by inf. What the loss-scale tests drive without a model.

    >>> import keras, numpy as np
    >>> w = keras.Variable(np.ones(2, np.float32))
    >>> opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=8.0)
    >>> step = optimizer_step(opt, [w], lambda: keras.ops.sum(w * w))
    >>> step(True); float(opt.dynamic_scale.numpy()), step(False), float(opt.dynamic_scale.numpy())
    (4.0, None, 4.0)
    """
    name = keras.backend.backend()
    if name == "tensorflow":
        import tensorflow as tf

        @tf.function
        def tf_step(poison: Any) -> None:
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(loss_fn() * _factor(poison))
            opt.apply_gradients(zip(tape.gradient(scaled, variables), variables))

        return lambda poison: tf_step(tf.constant(poison)) and None
    if name == "torch":
        def torch_step(poison: bool) -> None:
            for v in variables:
                v.value.grad = None
            opt.scale_loss(loss_fn() * _factor(ops.convert_to_tensor(poison))).backward()
            opt.apply_gradients([(v.value.grad, v) for v in variables])
            for v in variables:
                v.value.grad = None

        return torch_step
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
        for var, value in (*zip(variables, new_tv, strict=True), *zip(opt.variables, new_ov, strict=True)):
            var.assign(value)

    return jax_step


def _factor(poison: Any) -> Any:
    return ops.where(poison, ops.convert_to_tensor(np.inf, "float32"), ops.convert_to_tensor(1.0, "float32"))


def _tf_step(amp: Any, loss_fn: Loss, x: Any, y: Any, poison: bool) -> float:
    import tensorflow as tf

    def step(x: Any, y: Any, poison: Any) -> Any:
        variables = amp.model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_fn(amp.model(x, training=True), y)
            scaled = amp.scale_loss(loss * _factor(poison))
        grads = tape.gradient(scaled, variables)
        amp.apply_gradients(zip(grads, variables))
        return loss

    if getattr(amp, "_binding", None) is not None and amp._binding.fp8:
        fn = _JITTED.setdefault(amp, tf.function(step))
        return float(fn(tf.constant(x), tf.constant(y), tf.constant(poison)))
    return float(step(x, y, tf.constant(poison)))


def _torch_step(amp: Any, loss_fn: Loss, x: Any, y: Any, poison: bool) -> float:
    variables = amp.model.trainable_variables
    loss = loss_fn(amp.model(x, training=True), ops.convert_to_tensor(y))
    scaled = amp.scale_loss(loss * _factor(ops.convert_to_tensor(poison)))
    for v in variables:
        v.value.grad = None
    scaled.backward()
    grads = [v.value.grad for v in variables]
    amp.apply_gradients(zip(grads, variables))
    for v in variables:
        v.value.grad = None
    return float(ops.convert_to_numpy(loss))


def _jax_step(amp: Any, loss_fn: Loss, x: Any, y: Any, poison: bool) -> float:
    import jax

    model, opt = amp.model, amp.optimizer
    if opt is None:
        raise ValueError("custom_step: unimp.apply was given no optimizer")
    if not opt.built:
        opt.build(model.trainable_variables)
    step = _JITTED.get(amp)
    if step is None:
        step = _JITTED[amp] = jax.jit(_jax_pure_step(amp, loss_fn))
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]
    ov = [v.value for v in opt.variables]
    loss, tv, ntv, ov = step(tv, ntv, ov, x, y, poison)
    for group, values in ((model.trainable_variables, tv), (model.non_trainable_variables, ntv),
                          (opt.variables, ov)):
        for var, value in zip(group, values, strict=True):
            var.assign(value)
    return float(loss)


def _jax_pure_step(amp: Any, loss_fn: Loss) -> Callable[..., Any]:
    """The pure step ``(trainable, non-trainable, optimizer values, x, y, poison) -> (loss, new values...)``."""
    import jax

    model, opt = amp.model, amp.optimizer

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

    return pure
