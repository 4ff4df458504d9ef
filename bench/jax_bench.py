"""unimp-jax vs hand-written Flax mixed precision: one jitted training step, side by side.

Variants (same GPT-style model code, same data, same optax.adamw, one process, interleaved rounds):
  fp32     the model as built (float32 params and compute; XLA's default matmul precision)
  native   hand-written: every Linear/attention built with dtype=bfloat16 (fp32 params), LayerNorms
           in float32, logits cast to float32 for the loss — what a Flax user writes by hand
  unimp    the float32-built model under unimp.apply("mixed_bf16", model, tx)

Attention is jax.nn.dot_product_attention (implementation="cudnn" on GPU for bf16 inputs, XLA
otherwise) — under unimp it runs on the bf16 projections the policy produces, so cuDNN is used too.

    python bench/jax_bench.py            # CPU config (d=256, T=128, batch 8, 2 layers, 4k head)
    python bench/jax_bench.py --gpu      # H200 config (d=2048, T=2048, batch 8, 2 layers + 32k head)
    python bench/jax_bench.py --smoke    # tiny, seconds (tests the script)

Needs jax, flax, optax, numpy, unimp and unimp-jax (PYTHONPATH=.:backends/jax works without
installing). Prints a markdown table; writes $OUT/jax_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "backends" / "jax"):  # run from a checkout without installing
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import unimp  # noqa: E402


@dataclass(frozen=True)
class Config:
    d: int
    heads: int
    seq: int
    batch: int
    layers: int
    vocab: int
    rounds: int
    steps: int  # per round and variant


CONFIGS = {
    "smoke": Config(d=32, heads=2, seq=16, batch=2, layers=1, vocab=64, rounds=3, steps=7),
    "cpu": Config(d=256, heads=4, seq=128, batch=8, layers=2, vocab=4096, rounds=5, steps=6),
    "gpu": Config(d=2048, heads=16, seq=2048, batch=8, layers=2, vocab=32000, rounds=5, steps=6),
}


class Attention(nnx.Module):
    def __init__(self, cfg: Config, dtype: Any, impl: str | None, rngs: nnx.Rngs) -> None:
        self.qkv = nnx.Linear(cfg.d, 3 * cfg.d, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(cfg.d, cfg.d, dtype=dtype, rngs=rngs)
        self.heads, self.impl = cfg.heads, impl

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, d // self.heads), 3, axis=2)
        impl = self.impl if q.dtype in (jnp.bfloat16, jnp.float16) else None
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
    def __init__(self, cfg: Config, dtype: Any, impl: str | None, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.attn = Attention(cfg, dtype, impl, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.fc1 = nnx.Linear(cfg.d, 4 * cfg.d, dtype=dtype, rngs=rngs)
        self.fc2 = nnx.Linear(4 * cfg.d, cfg.d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x)).astype(x.dtype)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)))).astype(x.dtype)


class GPT(nnx.Module):
    def __init__(self, cfg: Config, dtype: Any = None, impl: str | None = None, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(cfg.vocab, cfg.d, rngs=rngs)
        self.blocks = getattr(nnx, "List", list)([Block(cfg, dtype, impl, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.d, rngs=rngs)
        self.head = nnx.Linear(cfg.d, cfg.vocab, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model: GPT, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    logits = model(tokens).astype(jnp.float32)  # native casts by hand; under unimp already float32
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def jitted(model: Any, optimizer: Any, grad_fn: Any) -> tuple[Any, Any]:
    """A pure jitted step over the split state (no per-call nnx graph traversal): (step, state)."""
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit
    def step(state: Any, tokens: jax.Array, targets: jax.Array) -> tuple[Any, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, optimizer, tokens, targets)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, state


def build(variant: str, cfg: Config, impl: str | None) -> tuple[Any, Any, Any]:
    tx = optax.adamw(1e-4)
    if variant == "native":
        model = GPT(cfg, jnp.bfloat16, impl)
        grad = lambda m, o, t, y: nnx.value_and_grad(loss_fn)(m, t, y)
        return (*jitted(model, nnx.Optimizer(model, tx, wrt=nnx.Param), grad), None)
    if variant == "fp32":
        model = GPT(cfg, None, impl)
        grad = lambda m, o, t, y: nnx.value_and_grad(loss_fn)(m, t, y)
        return (*jitted(model, nnx.Optimizer(model, tx, wrt=nnx.Param), grad), None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.UnimpWarning)  # bf16 on XLA:CPU is slow: known
        amp = unimp.apply("mixed_bf16", GPT(cfg, None, impl), tx)
    vg = amp.value_and_grad(loss_fn)

    def grad(m: Any, o: Any, t: jax.Array, y: jax.Array) -> tuple[Any, Any]:
        loss, grads, _ = vg(o, m, t, y)
        return loss, grads

    return (*jitted(amp.model, amp.optimizer, grad), amp)


def run(cfg: Config, variants: tuple[str, ...]) -> dict[str, Any]:
    on_gpu = jax.default_backend() == "gpu"
    impl = "cudnn" if on_gpu else None
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    steps, states, first, compile_s, amp = {}, {}, {}, {}, None
    for v in variants:
        t0 = time.perf_counter()
        steps[v], states[v], maybe_amp = build(v, cfg, impl)
        amp = maybe_amp or amp
        states[v], loss = steps[v](states[v], tokens, targets)  # compile + first step
        first[v] = float(loss)
        states[v], loss = steps[v](states[v], tokens, targets)
        jax.block_until_ready(loss)
        compile_s[v] = time.perf_counter() - t0
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(cfg.rounds):  # interleaved, so drift and neighbours hit every variant alike
        for v in variants:
            for _ in range(cfg.steps):
                t0 = time.perf_counter()
                states[v], loss = steps[v](states[v], tokens, targets)
                jax.block_until_ready(loss)
                times[v].append(time.perf_counter() - t0)
    med = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}
    if amp is not None:  # the functional loop kept its own state: hand it back for the report
        nnx.update((amp.model, amp.optimizer), states["unimp"])
    report = str(amp.report(tokens)) if amp is not None else ""
    return {"config": asdict(cfg), "backend": jax.default_backend(), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "attention": impl or "xla", "median_ms": med,
            "steps_timed": {v: len(ts) for v, ts in times.items()}, "compile_s": compile_s,
            "first_loss": first, "ratio_unimp_over_native": med["unimp"] / med["native"],
            "python": platform.python_version(), "unimp_report": report}


def table(res: dict[str, Any]) -> str:
    med, base = res["median_ms"], res["median_ms"].get("fp32")
    rows = ["| variant | ms/step (median) | vs fp32 | first loss |", "|---|---:|---:|---:|"]
    for v, ms in med.items():
        speed = f"{base / ms:.2f}x" if base else "-"
        rows.append(f"| {v} | {ms:.2f} | {speed} | {res['first_loss'][v]:.4f} |")
    cfg = res["config"]
    head = (f"JAX {res['jax']} on {res['device']} ({res['backend']}), d={cfg['d']} T={cfg['seq']} "
            f"batch={cfg['batch']} layers={cfg['layers']} vocab={cfg['vocab']}, attention={res['attention']}, "
            f"{res['steps_timed']['unimp']} timed steps per variant\n\n")
    return head + "\n".join(rows) + f"\n\nunimp / native = **{res['ratio_unimp_over_native']:.3f}**\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="the H200 config")
    mode.add_argument("--smoke", action="store_true", help="tiny CPU config to test the script")
    parser.add_argument("--no-fp32", action="store_true", help="skip the fp32 baseline")
    args = parser.parse_args(argv)
    cfg = CONFIGS["gpu" if args.gpu else "smoke" if args.smoke else "cpu"]
    variants = ("native", "unimp") if args.no_fp32 else ("fp32", "native", "unimp")
    res = run(cfg, variants)
    print(table(res))
    print(res["unimp_report"])
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "jax_bench.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
