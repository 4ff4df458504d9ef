"""Data-parallel Flax nnx training on 2 host devices under one unimp policy (CPU is fine).

The global batch is split over a 1-D mesh axis 'data' (``jax.shard_map`` through
``amp.data_parallel``); gradients are all-reduced in the policy's ``distributed.reduce_dtype`` and
every device agrees on finiteness. The example trains with the team policy switched to float16 with
dynamic loss scaling and a bfloat16 gradient all-reduce, injects an overflow on device 1 only at one
step, and shows that both devices skip it, keep identical params, and that the loss-scale trajectory
is the core's reference.

    python examples/jax_sharded.py [POLICY] [--steps 12] [--devices 2]
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def _force_host_devices(n: int) -> None:
    """Ask XLA:CPU for ``n`` devices; must happen before JAX starts (so before `import jax`)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", nargs="?", help="policy file or preset (default: examples/team_policy.toml)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("run this as a script: it sets XLA_FLAGS before JAX starts")
    _force_host_devices(args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import warnings
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import unimp
    from unimp.loss_scale import LossScale

    here = Path(__file__).resolve().parent
    source = args.policy or (here / "team_policy.toml")
    policy = unimp.load(source).replace(
        compute_dtype="float16",  # fp16 so that loss scaling (and a skipped step) has something to do
        # (mixed_bf16, which the team policy extends, sets skip_nonfinite = false: bf16 needs no skipping)
        loss_scale={"mode": "dynamic", "skip_nonfinite": True, "initial": 1024.0, "growth_interval": 4},
        distributed={"reduce_dtype": "bfloat16"})
    n = jax.device_count()
    vocab, d, t, classes, per_device = 256, 64, 16, 16, 8
    batch = per_device * n

    class Tagger(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
            self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
            self.head = nnx.Linear(d, classes, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens)
            x = x + self.fc2(jax.nn.gelu(self.fc1(self.norm(x)))).astype(x.dtype)
            return self.head(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.UnimpWarning)  # fp16 on XLA:CPU is slow: known
        amp = unimp.apply(policy, Tagger(nnx.Rngs(0)), optax.adamw(3e-3))
    print(f"policy {policy.name!r} ({policy.fingerprint}): compute {amp.plan.compute_dtype}, loss scale "
          f"{policy.loss_scale.mode}, gradient all-reduce in {policy.distributed.reduce_dtype}, "
          f"{n} devices: {', '.join(str(x) for x in jax.devices())}")

    def loss_fn(model: nnx.Module, tokens: jax.Array, targets: jax.Array, poison: jax.Array) -> jax.Array:
        logits = model(tokens).astype(jnp.float32)  # the loss in float32, whatever the head ran in
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(-1)
        return (per_example * jnp.where(poison, jnp.inf, 1.0)).mean()  # a poisoned row overflows its device

    grad_fn = amp.value_and_grad(loss_fn, axis_name="data")  # reduce in reduce_dtype, agree on finiteness

    def train_step(model, optimizer, tokens, targets, poison):  # runs per device, inside shard_map
        loss, grads, finite = grad_fn(optimizer, model, tokens, targets, poison)
        optimizer.update(model, grads)  # skipped (bit for bit) on every device when not finite
        return loss, finite

    step = amp.data_parallel(train_step)  # jit(shard_map(...)) over mesh axis 'data', state donated
    rng = np.random.default_rng(0)
    bad_step = min(3, args.steps - 1)
    reference, ref_state = LossScale(policy.loss_scale), LossScale(policy.loss_scale).initial_state()
    for i in range(args.steps):
        tokens = rng.integers(0, vocab, (batch, t)).astype(np.int32)
        poison = np.zeros(batch, bool)
        poison[-1] = i == bad_step  # the last row is on the last device only
        before = np.asarray(amp.model.fc1.kernel.get_value())
        loss, finite = step(amp.model, amp.optimizer, tokens, tokens % classes, poison)
        kernel = amp.model.fc1.kernel.get_value()
        replicas = [np.asarray(s.data) for s in kernel.addressable_shards]
        same = all(np.array_equal(replicas[0], r) for r in replicas[1:])
        flags = [bool(s.data) for s in finite.addressable_shards]
        ref_state = reference.update(ref_state, i != bad_step).state
        assert amp.loss_scale_state() == ref_state, (amp.loss_scale_state(), ref_state)
        assert same, "replicas diverged"
        note = ""
        if i == bad_step:
            assert flags == [False] * n and np.array_equal(before, replicas[0])
            note = f"  <- overflow injected on device {n - 1} only: skipped on both devices, params unchanged"
        print(f"step {i:2d}  loss {float(loss):8.4f}  finite per device {flags}  scale {amp.scale:8.0f}  "
              f"replicas identical {same}{note}")
    print(f"skipped {amp.skipped_steps} of {args.steps} steps; loss-scale trajectory = unimp.loss_scale.LossScale")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
