"""Lifetimes of applied Keras models on every Keras backend: the sweep (or notebook re-run) pattern that drops
each trial's Amp without ``amp.remove()``, collected whenever the garbage collector runs."""

from __future__ import annotations

import keras
import numpy as np

import unimp
from unimp.conformance.stress import dead_marks, race_applies, sweep_every_preset


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
    race_applies(lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(8)]),
                 lambda m: unimp.apply("mixed_bf16", m),
                 lambda m: ([(v.path, str(v.dtype), v.numpy().tobytes()) for v in m.weights],
                            m.layers[0].dtype_policy.name))
