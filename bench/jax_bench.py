"""unimp-jax vs hand-written Flax mixed precision: one jitted training step, side by side.

Variants (same GPT-style model code, same data, same optax.adamw, one process, interleaved rounds,
state donated to the jitted step in every variant):
  fp32     the model as built (float32 params and compute; XLA's default matmul precision)
  native   hand-written: every Linear/attention built with dtype=bfloat16 (fp32 params), LayerNorms
           in float32, logits cast to float32 for the loss — what a Flax user writes by hand
  unimp    the float32-built model under unimp.apply("mixed_bf16", model, tx)
  native_b (--control) a second native build: native_b/native is the ratio's noise floor (A/A)

native makes exactly mixed_bf16's per-layer decisions (embedding: follows its int input, so its
float32 params; Linear/attention bf16; LayerNorm float32; gelu and residual adds follow inputs;
logits float32), so both bf16 variants lower to the same converts and matmuls: the ratio is unimp's
cost around the same graph, not a dtype difference.

Attention is jax.nn.dot_product_attention (implementation="cudnn" on GPU for bf16 inputs, XLA
otherwise) — under unimp it runs on the bf16 projections the policy produces, so cuDNN is used too.

    python bench/jax_bench.py            # CPU config (d=256, T=128, batch 8, 2 layers, 4k head)
    python bench/jax_bench.py --gpu      # H200 config (d=2048, T=2048, batch 8, 2 layers + 32k head)
    python bench/jax_bench.py --smoke    # tiny, seconds (tests the script)
    --no-fp32 (skip the baseline), --control (add native_b), --rounds N

Needs jax, flax, optax, numpy, unimp and unimp-jax (PYTHONPATH=.:backends/jax works without
installing). Prints a markdown table; writes $OUT/jax_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import re
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
from unimp.backend.registry import backends, register_backend  # noqa: E402

if "jax" not in backends():  # a checkout without unimp-jax installed: no entry point, register it
    from unimp_jax import JaxBackend

    register_backend(JaxBackend)


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
    "smoke": Config(d=32, heads=2, seq=16, batch=2, layers=1, vocab=64, rounds=4, steps=4),
    "cpu": Config(d=256, heads=4, seq=128, batch=8, layers=2, vocab=4096, rounds=6, steps=5),
    "gpu": Config(d=2048, heads=16, seq=2048, batch=8, layers=2, vocab=32000, rounds=12, steps=5),
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


DONATE = True  # --no-donate turns it off (to measure what donation changes)


def jitted(model: Any, optimizer: Any, grad_fn: Any) -> tuple[Any, Any]:
    """A pure jitted step over the split state (no per-call nnx graph traversal): (step, state).

    The state is donated (as a real training loop does): params and optimizer state are updated in
    place, and state the step passes through unchanged costs no copy.
    """
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0 if DONATE else ())
    def step(state: Any, tokens: jax.Array, targets: jax.Array) -> tuple[Any, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, optimizer, tokens, targets)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, state


def build(variant: str, cfg: Config, impl: str | None) -> tuple[Any, Any, Any]:
    tx = optax.adamw(1e-4)
    if variant in ("native", "native_b"):  # native_b: a second, separately built native (A/A control)
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


def hlo_ops(step: Any, state: Any, tokens: jax.Array, targets: jax.Array) -> dict[str, int]:
    """Op counts of the compiled (optimised) HLO of one step: what the device really runs."""
    text = step.lower(state, tokens, targets).compile().as_text()
    counts: dict[str, int] = {}
    for m in re.finditer(r"=\s*(?:\([^)]*\)|\S+)\s+([a-z][\w-]*)\(", text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    for m in re.finditer(r'custom_call_target="([^"]+)"', text):
        key = f"custom-call:{m.group(1)}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def hlo_diff(a: dict[str, int], b: dict[str, int]) -> dict[str, tuple[int, int]]:
    return {k: (a.get(k, 0), b.get(k, 0)) for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)}


def interleaved(steps: dict[str, Any], states: dict[str, Any], variants: list[str], n_rounds: int,
                n_steps: int, *args: Any) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
    """Time ``steps[v](states[v], *args)`` in interleaved rounds (``states`` is updated in place).

    The order rotates and reverses so every variant takes every position and follows every other one
    equally often (clock drift, neighbours and warm caches hit all alike). Returns every step's
    seconds per variant and, per round, the median ms of each variant."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    rounds: list[dict[str, float]] = []
    n = len(variants)
    for r in range(n_rounds):
        order = variants[r % n:] + variants[:r % n]
        order = order[::-1] if (r // n) % 2 else order
        per: dict[str, float] = {}
        for v in order:
            ts = []
            for _ in range(n_steps):
                t0 = time.perf_counter()
                states[v], loss = steps[v](states[v], *args)
                jax.block_until_ready(loss)
                ts.append(time.perf_counter() - t0)
            times[v] += ts
            per[v] = statistics.median(ts) * 1e3
        rounds.append(per)
    return times, rounds


def run(cfg: Config, variants: tuple[str, ...], hlo: bool = False) -> dict[str, Any]:
    on_gpu = jax.default_backend() == "gpu"
    impl = "cudnn" if on_gpu else None
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    steps, states, first, compile_s, amp, ops = {}, {}, {}, {}, None, {}
    for v in variants:
        t0 = time.perf_counter()
        steps[v], states[v], maybe_amp = build(v, cfg, impl)
        amp = maybe_amp or amp
        if hlo and v in ("native", "unimp"):
            ops[v] = hlo_ops(steps[v], states[v], tokens, targets)
        states[v], loss = steps[v](states[v], tokens, targets)  # compile + first step
        first[v] = float(loss)
        states[v], loss = steps[v](states[v], tokens, targets)
        jax.block_until_ready(loss)
        compile_s[v] = time.perf_counter() - t0
    times, rounds = interleaved(steps, states, list(variants), cfg.rounds, cfg.steps, tokens, targets)
    paired = {v: statistics.median(p[v] / p["native"] for p in rounds) for v in variants}
    med = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}
    if amp is not None:  # the functional loop kept its own state: hand it back for the report
        nnx.update((amp.model, amp.optimizer), states["unimp"])
    report = str(amp.report(tokens)) if amp is not None else ""
    return {"config": asdict(cfg), "backend": jax.default_backend(), "device": str(jax.devices()[0]),
            "jax": jax.__version__, "attention": impl or "xla", "median_ms": med,
            "steps_timed": {v: len(ts) for v, ts in times.items()}, "compile_s": compile_s,
            "first_loss": first, "ratio_unimp_over_native": med["unimp"] / med["native"],
            "donated": DONATE, "round_ratio_median_over_native": paired, "round_medians_ms": rounds,
            "hlo_ops_native_vs_unimp": hlo_diff(ops["native"], ops["unimp"]) if ops else None,
            "python": platform.python_version(), "unimp_report": report}


def table(res: dict[str, Any]) -> str:
    med, base = res["median_ms"], res["median_ms"].get("fp32")
    paired = res["round_ratio_median_over_native"]
    rows = ["| variant | ms/step (median) | vs fp32 | / native (median of per-round ratios) | first loss |",
            "|---|---:|---:|---:|---:|"]
    for v, ms in med.items():
        speed = f"{base / ms:.2f}x" if base else "-"
        rows.append(f"| {v} | {ms:.2f} | {speed} | {paired[v]:.3f} | {res['first_loss'][v]:.4f} |")
    cfg = res["config"]
    head = (f"JAX {res['jax']} on {res['device']} ({res['backend']}), d={cfg['d']} T={cfg['seq']} "
            f"batch={cfg['batch']} layers={cfg['layers']} vocab={cfg['vocab']}, attention={res['attention']}, "
            f"{res['steps_timed']['unimp']} timed steps per variant, state "
            f"{'donated' if res['donated'] else 'not donated'}\n\n")
    return head + "\n".join(rows) + f"\n\nunimp / native = **{res['ratio_unimp_over_native']:.3f}**\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="the H200 config")
    mode.add_argument("--smoke", action="store_true", help="tiny CPU config to test the script")
    parser.add_argument("--no-fp32", action="store_true", help="skip the fp32 baseline")
    parser.add_argument("--control", action="store_true",
                        help="add native_b, a second native build (A/A: the noise floor of the ratio)")
    parser.add_argument("--hlo", action="store_true",
                        help="also compare the compiled HLO of the native and unimp steps (op counts)")
    parser.add_argument("--no-donate", action="store_true", help="do not donate the state to the step")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: per config)")
    args = parser.parse_args(argv)
    cfg = CONFIGS["gpu" if args.gpu else "smoke" if args.smoke else "cpu"]
    global DONATE
    DONATE = not args.no_donate
    if args.rounds:
        cfg = dataclasses.replace(cfg, rounds=args.rounds)
    variants = ("native", "unimp") if args.no_fp32 else ("fp32", "native", "unimp")
    variants += ("native_b",) if args.control else ()
    res = run(cfg, variants, hlo=args.hlo)
    print(table(res))
    if res["hlo_ops_native_vs_unimp"] is not None:
        diff = res["hlo_ops_native_vs_unimp"]
        print("compiled HLO, ops whose count differs (native, unimp):",
              ", ".join(f"{k} {a}/{b}" for k, (a, b) in diff.items()) or "none", "\n")
    print(res["unimp_report"])
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "jax_bench.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
