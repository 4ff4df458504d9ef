"""Train a small Flax nnx model on synthetic data under the team's unimp policy (CPU is fine).

Uses examples/team_policy.toml when present (else the mixed_bf16 preset), prints the Plan, the
Report of what ran, the losses, and time per step against the same model in fp32.

    python examples/jax_train.py [POLICY] [--steps 30]
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import unimp
from unimp_jax import Op

HERE = Path(__file__).resolve().parent
VOCAB, D, T, B, CLASSES = 512, 128, 32, 16, 16


class Classifier(nnx.Module):
    """embed -> attention block -> MLP -> head, token classification."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=D, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, 4 * D, rngs=rngs)
        self.act = Op(jax.nn.gelu)
        self.fc2 = nnx.Linear(4 * D, D, rngs=rngs)
        self.head = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x))
        x = x + self.fc2(self.act(self.fc1(self.norm2(x))))
        return self.head(x)


def loss_fn(model: Classifier, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    # the loss in float32: with output_dtype "unchanged" (mixed_bf16) the logits are in the head's dtype
    logits = model(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def batches(n: int, seed: int = 0) -> list[tuple[jax.Array, jax.Array]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, size=(B, T))
        out.append((jnp.asarray(tokens, jnp.int32), jnp.asarray((tokens * 7) % CLASSES, jnp.int32)))
    return out


def train(policy: unimp.Policy, steps: int, verbose: bool) -> tuple[list[float], float]:
    amp = unimp.apply(policy, Classifier(nnx.Rngs(0)), optax.adamw(3e-3))

    @nnx.jit
    def step(model: Classifier, optimizer: nnx.Optimizer, tokens: jax.Array, targets: jax.Array):
        loss, grads, finite = amp.value_and_grad(loss_fn)(optimizer, model, tokens, targets)
        optimizer.update(model, grads)  # skipped (bit for bit) when grads are not finite
        return loss, finite

    data = batches(steps)
    losses, times = [], []
    for tokens, targets in data:
        t0 = time.perf_counter()
        loss, _ = step(amp.model, amp.optimizer, tokens, targets)
        losses.append(float(loss))  # float() waits for the step
        times.append(time.perf_counter() - t0)
    if verbose:
        print(amp.plan, end="\n\n")
        print(amp.report(), end="\n\n")
        print("state_dict:", amp.state_dict(), end="\n\n")
    amp.remove()
    return losses, float(np.median(times[3:]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", nargs="?", help="policy file or preset (default: examples/team_policy.toml)")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    team = HERE / "team_policy.toml"
    policy = unimp.load(args.policy or (str(team) if team.exists() else "mixed_bf16"))
    print(f"policy {policy.name!r} ({policy.source}), JAX on {jax.default_backend()}\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", unimp.UnimpWarning)
        losses, t_policy = train(policy, args.steps, verbose=True)
    for w in caught:
        print(f"warning: {w.message}")
    base, t_fp32 = train(unimp.load("fp32"), args.steps, verbose=False)
    print("step  loss(policy)  loss(fp32)")
    for i in range(0, args.steps, max(1, args.steps // 10)):
        print(f"{i:4d}  {losses[i]:12.4f}  {base[i]:10.4f}")
    print(f"\ntime/step (median after warm-up): policy {t_policy * 1e3:.2f} ms, fp32 {t_fp32 * 1e3:.2f} ms "
          f"({t_policy / t_fp32:.2f}x)")


if __name__ == "__main__":
    main()
