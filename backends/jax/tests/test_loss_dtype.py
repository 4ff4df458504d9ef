"""A loss traced in low precision outside the policy is pointed out by ``amp.value_and_grad`` (once)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import unimp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc1, self.fc2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def _warnings(cast: bool) -> list[str]:
    amp = unimp.apply("mixed_bf16", MLP(nnx.Rngs(0)), optax.sgd(0.1))

    def loss_fn(model, x, y):
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32) if cast else logits, y).mean()

    x, y = jnp.ones((4, 8)), jnp.zeros((4,), jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            amp.value_and_grad(loss_fn)(amp.optimizer, amp.model, x, y)
    return [str(w.message) for w in caught if "the loss reached the Amp" in str(w.message)]


def test_a_bfloat16_loss_warns_once_a_float32_one_is_silent():
    found = _warnings(cast=False)
    assert len(found) == 1 and "bfloat16" in found[0]
    assert _warnings(cast=True) == []
