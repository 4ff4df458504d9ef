"""The small models the JAX FP8 tests train: two FP8-eligible layers and a head whose width (10)
is not a multiple of 16, so it stays in the compute dtype."""

import jax
from flax import linen as nn
from flax import nnx


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(32, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, 16, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)  # 10: not a multiple of 16, stays bf16

    def __call__(self, x):
        return self.head(jax.nn.relu(self.fc2(jax.nn.relu(self.fc1(x)))))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.relu(nn.Dense(64, name="fc1")(x))
        return nn.Dense(10, name="head")(jax.nn.relu(nn.Dense(16, name="fc2")(h)))
