"""A real Keras training step whose gradient is finite or inf as asked, on every Keras backend (each
backend's own step: :func:`unimp_keras.steps.optimizer_step`): drives a LossScaleOptimizer (Keras' own
or unimp's) through a finite/non-finite sequence in the loss-scale and migration tests."""

import keras
import numpy as np

from unimp_keras.steps import optimizer_step


def tiny_variable() -> keras.Variable:
    """A real variable (the optimizer builds its slots for it)."""
    return keras.Variable(np.array([1.0, -2.0], np.float32), name="w")


def step_fn(opt, w):
    """``step(poison)``: one scaled step of ``opt`` on ``w``; the gradient is inf when ``poison``."""
    return optimizer_step(opt, [w], lambda: 1e-30 * keras.ops.sum(w * w))


def replay_scales(opt, finites) -> list[float]:
    """The scale of ``opt`` (a Keras LossScaleOptimizer) after each step of ``finites``."""
    step = step_fn(opt, tiny_variable())
    scales = []
    for finite in finites:
        step(not finite)
        scales.append(float(opt.dynamic_scale.numpy()))
    return scales
