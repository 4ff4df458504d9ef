"""A real Keras training step whose gradient is finite or inf as asked: drives a LossScaleOptimizer
(Keras' own or unimp's) through a finite/non-finite sequence in the loss-scale and migration tests."""

import keras
import numpy as np
import tensorflow as tf


def tiny_variable() -> keras.Variable:
    """A real variable (the optimizer builds its slots for it)."""
    return keras.Variable(np.array([1.0, -2.0], np.float32), name="w")


def step_fn(opt, w):
    """``step(poison)``: one scaled step of ``opt`` on ``w``; the gradient is inf when ``poison``."""
    @tf.function
    def step(poison):
        with tf.GradientTape() as tape:
            loss = 1e-30 * tf.reduce_sum(w * w) * tf.where(poison, tf.constant(np.inf, tf.float32), 1.0)
            scaled = opt.scale_loss(loss)
        opt.apply_gradients([(tape.gradient(scaled, w), w)])
    return step


def replay_scales(opt, finites) -> list[float]:
    """The scale of ``opt`` (a Keras LossScaleOptimizer) after each step of ``finites``."""
    step = step_fn(opt, tiny_variable())
    scales = []
    for finite in finites:
        step(tf.constant(not finite))
        scales.append(float(opt.dynamic_scale.numpy()))
    return scales
