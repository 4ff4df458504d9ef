"""unimp-jax keeps neither the model nor the user's optax transformation alive after ``amp.remove()``."""

from __future__ import annotations

import gc
import weakref

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
