"""unimp-jax keeps neither the model nor the user's optax transformation alive after ``amp.remove()``."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import optax
from flax import nnx

import unimp
from unimp_jax.backend import wrap
from unimp_jax.optimizer import may_skip


def test_model_and_transformation_are_collected_after_remove():
    model, tx = nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1)
    refs = [weakref.ref(model), weakref.ref(tx.update)]  # an optax transformation is a NamedTuple: its update
    amp = unimp.apply("mixed_fp16", model, tx)
    amp.remove()
    del model, tx, amp
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_wrap_is_memoised_while_the_wrapped_transformation_lives():
    tx, policy = optax.sgd(0.1), unimp.load("mixed_fp16")
    first = wrap(tx, policy)
    assert wrap(tx, policy).update is first.update and wrap(tx, policy) == first
    assert wrap(tx, unimp.load("fp32")).update is not first.update
    assert may_skip(first) and not may_skip(wrap(tx, unimp.load("fp32"))) and may_skip(tx)


def test_sweep_of_dropped_amps_every_preset_cycles_random_collections_and_freezes():
    """The sweep pattern (and a notebook cell re-run): 200 applies with SGD-with-momentum state and a forward,
    each Amp dropped without remove() in a cycle with its model, collections at random points (inside unimp's
    claim and marks too) and gc.freeze(), under a watchdog; nothing of them stays, no applied mark is left."""
    from unimp.conformance.stress import dead_marks, sweep_every_preset

    x = np.ones((2, 8), np.float32)

    def trial(preset):
        model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        amp = unimp.apply(preset, model, optax.sgd(0.1, momentum=0.9))
        amp.model(x)
        return model, amp

    def linears() -> set[int]:  # earlier tests' models may still be alive (jit caches, fixtures): not the sweep's
        gc.collect()
        return {id(o) for o in gc.get_objects() if isinstance(o, nnx.Linear)}

    before = linears()
    presets, gcs = sweep_every_preset(trial, seed=4)
    assert gcs.inside["claim"] > 0 and len(presets) > 10 and not dead_marks()
    assert linears() <= before


def test_a_report_in_one_thread_records_only_its_own_layer_calls():
    """An evaluation thread taking amp.report(x) while a trainer thread runs another model's forward: the
    report's rows are its own model's (the recordings were one process-wide stack that the other thread's
    layer calls wrote into)."""
    import sys
    import threading
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        low = unimp.apply("mixed_bf16", nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1))
        full = unimp.apply("fp32", nnx.Linear(8, 8, rngs=nnx.Rngs(1)), optax.sgd(0.1))
    x = np.ones((2, 8), np.float32)
    interval, stop, seen = sys.getswitchinterval(), threading.Event(), []
    sys.setswitchinterval(1e-6)

    def train():
        while not stop.is_set():
            full.model(x)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        for _ in range(100):
            seen.append(low.report(x).rows[0].compute_dtype)
    finally:
        stop.set()
        trainer.join()
        sys.setswitchinterval(interval)
    assert seen == ["bfloat16"] * 100
    low.remove()
    full.remove()
