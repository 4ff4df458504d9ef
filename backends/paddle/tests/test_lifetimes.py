"""Lifetimes of applied Paddle (dygraph) models: the sweep (or notebook re-run) pattern that drops each
trial's Amp without ``amp.remove()``, collected whenever the garbage collector runs."""

from __future__ import annotations

import paddle

import unimp
from unimp.conformance.stress import dead_marks, race_applies, sweep_every_preset


def trial(preset: str) -> tuple:
    """Apply (Momentum) and run a forward; the sweep drops model, optimizer and Amp in a cycle. Paddle 3.x
    has no CPU low-precision dygraph kernels: each preset runs with on_unsupported = "fallback" here."""
    model = paddle.nn.Linear(8, 8)
    opt = paddle.optimizer.Momentum(0.1, momentum=0.9, parameters=model.parameters())
    amp = unimp.apply(unimp.load(preset).replace(on_unsupported="fallback"), model, opt)
    amp.model(paddle.ones([2, 8]))
    return model, opt, amp


def test_sweep_of_dropped_amps_every_preset_cycles_random_collections_and_freezes():
    """200 applies round every preset, dropped without remove(), collections at random points (inside unimp's
    claim and marks too), gc.freeze() holding some back, under a watchdog: it finishes and leaves no applied
    mark behind."""
    presets, gcs = sweep_every_preset(trial, seed=6)
    assert gcs.inside["claim"] > 0 and len(presets) > 10 and not dead_marks()


def test_racing_applies_to_one_model_one_wins_the_other_gets_a_located_error():
    """Two threads applying to one Paddle layer (an evaluation thread beside the trainer): exactly one Amp, the
    other AlreadyAppliedError naming the model and the fix, in 100 of 100 races; remove() leaves the model as
    it was."""
    race_applies(lambda: paddle.nn.Linear(8, 8),
                 lambda m: unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), m),
                 lambda m: [(q.name, str(q.dtype), q.numpy().tobytes()) for q in m.parameters()])
