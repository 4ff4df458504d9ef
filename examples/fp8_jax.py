"""FP8 training with Flax nnx through a unimp preset, next to bf16 (CPU: emulated FP8).

    python examples/fp8_jax.py [--steps 40] [--policy fp8_tensorwise]

Every ``nnx.Linear`` whose dims are multiples of 16 runs scaled e4m3/e5m2 dots (the preset's
recipe); the rest runs bf16. Prints the report's FP8 column and the losses against ``mixed_bf16``.
"""

from __future__ import annotations

import fp8_compare  # examples/fp8_compare.py, beside this file
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import unimp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc1, self.fc2 = nnx.Linear(64, 128, rngs=rngs), nnx.Linear(128, 64, rngs=rngs)
        self.head = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(jax.nn.gelu(self.fc2(jax.nn.gelu(self.fc1(x)))))


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


def train(policy: str, steps: int) -> tuple[list[float], unimp.Amp]:
    amp = unimp.apply(policy, MLP(nnx.Rngs(0)), optax.adamw(3e-3))

    @nnx.jit
    def step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
        loss, grads, _ = amp.value_and_grad(loss_fn)(optimizer, model, x, y)
        optimizer.update(model, grads)
        return loss

    kx, ky = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(kx, (256, 64)), jax.random.randint(ky, (256,), 0, 16)
    return [float(step(amp.model, amp.optimizer, x, y)) for _ in range(steps)], amp


def main(argv: list[str] | None = None) -> tuple[list[float], list[float]]:
    return fp8_compare.main(__doc__, train, "steps", "fp8_tensorwise", argv)


if __name__ == "__main__":
    main()
