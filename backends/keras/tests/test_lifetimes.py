"""Lifetimes of applied Keras models on every Keras backend: the sweep (or notebook re-run) pattern that drops
each trial's Amp without ``amp.remove()``, collected whenever the garbage collector runs."""

from __future__ import annotations

import functools
import sys

import keras
import numpy as np

import unimp
from unimp.conformance.stress import dead_marks, sweep_every_preset, together


def trial(preset: str) -> tuple:
    """Apply (SGD with momentum) and run a forward; the sweep drops model, optimizer and Amp in a cycle."""
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    amp = unimp.apply(preset, model, opt)
    amp.model(np.ones((2, 8), np.float32))
    return model, opt, amp


def test_sweep_of_dropped_amps_every_preset_cycles_random_collections_and_freezes():
    """200 applies round every preset this Keras backend runs, dropped without remove(), collections at random
    points (inside unimp's claim and marks too), gc.freeze() holding some back, under a watchdog: it finishes
    and leaves no applied mark behind."""
    presets, gcs = sweep_every_preset(trial, seed=5)
    assert gcs.inside["claim"] > 0 and len(presets) > 10 and not dead_marks()


def test_racing_applies_to_one_model_one_wins_the_other_gets_a_located_error():
    """Two threads applying to one Keras model (an evaluation thread beside the trainer): exactly one Amp, the
    other AlreadyAppliedError naming the model and the fix, in 100 of 100 races; remove() leaves the model as
    it was."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads really race
    try:
        for _ in range(100):
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)])
            before = _state(model)
            out = together(*[functools.partial(unimp.apply, "mixed_bf16", model)] * 2)
            amps = [o for o in out if isinstance(o, unimp.Amp)]
            errors = [o for o in out if isinstance(o, unimp.AlreadyAppliedError)]
            assert len(amps) == 1 and len(errors) == 1, out
            assert "already has a unimp policy applied; call amp.remove()" in str(errors[0])
            amps[0].remove()
            assert _equal(before, model)
    finally:
        sys.setswitchinterval(interval)


def _state(model):
    return [(v.path, v.dtype, v.numpy().copy()) for v in model.weights], model.layers[0].dtype_policy.name


def _equal(before, model):
    (weights, policy), (now, now_policy) = before, _state(model)
    return policy == now_policy and len(now) == len(weights) and all(
        a[:2] == b[:2] and np.array_equal(a[2], b[2]) for a, b in zip(now, weights, strict=True))
