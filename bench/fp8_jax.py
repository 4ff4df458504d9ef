"""FP8 on JAX/Flax nnx: a GPT block trained in bf16 vs FP8 (four recipes), native vs unimp.

Speed (default): one jitted training step of a standard pre-LN GPT block (causal attention +
4x GELU MLP) on random activations, every variant in one process, interleaved rounds, state donated:

  bf16                hand-written Flax mixed precision: Linear(dtype=bfloat16), fp32 params
  native_<recipe>     hand-written FP8: each Linear's dot_general is a scaled FP8 dot written here with
                      flax.linen.fp8_ops — what a Flax user writes by hand:
                      delayed: Flax's own fp8_scaled_dot_general with its scale/amax-history Variables,
                        overwritten from their gradients (e4m3 forward, e5m2 gradient);
                      tensorwise: one scale per tensor from this step's amax (e4m3 / e5m2);
                      rowwise: one scale per row of each GEMM operand (amax over the GEMM's contracted
                        dim: activation and output gradient per row, weight per output column in the
                        forward), power-of-2 scales, e4m3 everywhere;
                      rowwise_gw_hp: rowwise forward, grad input with the weight scaled per tensor,
                        grad weight (x^T dy) in bf16, no power-of-2 rounding
                      (the recipes of torchao's Float8LinearConfig.from_recipe_name)
  unimp_<recipe>      the float32-built block under unimp.apply(policy, block, tx): the presets
                      fp8_delayed, fp8_tensorwise, fp8_rowwise; rowwise_gw_hp: fp8_rowwise with
                      recipe = "rowwise_gw_hp" (POLICIES below)
  native_<recipe>_b   (--control) a second, separately built native_<recipe>: the A/A noise floor

All four Linear layers (qkv, out, fc1, fc2) run FP8 in every FP8 variant (their dims are multiples of
16; rowwise_gw_hp keeps each grad-weight GEMM in bf16); attention's softmax(QK^T)V runs in bf16
(jax.nn.dot_product_attention, cuDNN on GPU). --recipes picks the recipes (default: all four).

Curve (--curve): a small GPT LM (2 blocks) trained N steps (default 300) on a fixed, seeded synthetic
corpus (a sparse random bigram language: every token has 4 likely successors) through unimp, in
mixed_bf16 and in each FP8 recipe, from the same init and batches; the loss every 25 steps and the
final-loss ratio FP8 / bf16.

    python bench/fp8_jax.py --smoke --curve --out /tmp/fp8   # CPU, tiny (tests the script; FP8 emulated)
    python bench/fp8_jax.py --gpu --control --curve --out $OUT   # H200: d=4096, T=2048
    python bench/fp8_jax.py --gpu --control --recipes tensorwise,rowwise_gw_hp --out $OUT   # a shorter run
    (a recipe's first build autotunes its FP8 GEMMs: 10-220 s on the H200; each build prints its phases)
    sizes: --d --heads --seq --batch --rounds --steps; curve: --curve-steps --curve-every

Needs jax, flax, optax, numpy (PYTHONPATH=.:backends/jax works without installing unimp). Prints
markdown tables; writes fp8_jax.json under --out.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.linen import fp8_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
# jax_bench puts this checkout on the path and registers unimp-jax when it is not installed
from jax_bench import interleaved

import unimp

RECIPES = ("delayed", "tensorwise", "rowwise", "rowwise_gw_hp")
POLICIES: dict[str, Any] = {  # what the unimp variants apply, per recipe
    "delayed": "fp8_delayed", "tensorwise": "fp8_tensorwise", "rowwise": "fp8_rowwise",
    "rowwise_gw_hp": {"name": "fp8_rowwise_gw_hp", "extends": "fp8_rowwise", "fp8": {"recipe": "rowwise_gw_hp"}},
}
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HISTORY = 16  # amax history of the delayed recipe (fp8_delayed's)


@dataclass(frozen=True)
class Config:
    d: int
    heads: int
    seq: int
    batch: int
    rounds: int
    steps: int  # timed steps per round and variant


CONFIGS = {
    "smoke": Config(d=32, heads=2, seq=16, batch=2, rounds=2, steps=2),
    "cpu": Config(d=256, heads=4, seq=128, batch=4, rounds=4, steps=3),
    "gpu": Config(d=4096, heads=32, seq=2048, batch=8, rounds=8, steps=5),
}


@dataclass(frozen=True)
class CurveConfig:
    d: int = 256
    heads: int = 4
    layers: int = 2
    seq: int = 128
    batch: int = 16
    vocab: int = 512
    steps: int = 300
    every: int = 25
    lr: float = 3e-3


# ---------------------------------------------------------------------- hand-written FP8 (native)
class Fp8Var(nnx.Variable):
    """A native delayed-scaling Variable (scale or amax history), overwritten with its gradient."""


def _amax_scale(x: jax.Array, q: Any, axis: int | None = None, pow2: bool = False) -> jax.Array:
    """amax / fp8 max (x / scale fills the format): over the whole tensor (shape (1,)) or over ``axis``
    (kept as a size-1 dim); 1 where the amax is 0. ``pow2``: the multiplier fp8 max / amax rounded
    down to a power of 2 (torchao's round_scales_to_power_of_2)."""
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=axis is not None).astype(jnp.float32)
    fmax = jnp.finfo(q).max.astype(jnp.float32)
    safe = jnp.where(amax > 0, amax, fmax)
    s = 1.0 / jnp.exp2(jnp.floor(jnp.log2(fmax / safe))) if pow2 else safe / fmax
    s = jnp.where(amax > 0, s, 1.0)
    return s if axis is not None else s.reshape(1)


def _q(x: jax.Array, q: Any, axis: int | None, pow2: bool) -> tuple[jax.Array, jax.Array]:
    """(x in the FP8 format q, its scale)."""
    s = _amax_scale(x, q, axis, pow2)
    return fp8_ops.quantize(x, q, s, x.dtype), s


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def tensorwise_dot(x: jax.Array, w: jax.Array, dn: Any) -> jax.Array:
    return _tw_fwd(x, w, dn)[0]


def _tw_fwd(x: jax.Array, w: jax.Array, dn: Any) -> tuple[jax.Array, Any]:
    sx, sw = _amax_scale(x, E4M3), _amax_scale(w, E4M3)
    qx, qw = fp8_ops.quantize(x, E4M3, sx, x.dtype), fp8_ops.quantize(w, E4M3, sw, x.dtype)
    y = jax.lax.dot_general(qx, qw, dn, preferred_element_type=x.dtype)
    return fp8_ops.dequantize(y, x.dtype, sx * sw), (x, w, qx, qw, sx, sw)


def _tw_bwd(dn: Any, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w, qx, qw, sx, sw = res
    sg = _amax_scale(g, E5M2)
    qg = fp8_ops.quantize(g, E5M2, sg, x.dtype)
    gx = fp8_ops.dot_general_transpose_lhs(qg, x, qw, dimension_numbers=dn, precision=None,
                                           preferred_element_type=x.dtype)
    gw = fp8_ops.dot_general_transpose_rhs(qg, qx, w, dimension_numbers=dn, precision=None,
                                           preferred_element_type=x.dtype)
    return fp8_ops.dequantize(gx, x.dtype, sw * sg), fp8_ops.dequantize(gw, x.dtype, sx * sg)


tensorwise_dot.defvjp(_tw_fwd, _tw_bwd)


def _mm(a: jax.Array, b: jax.Array, ca: int, cb: int, dtype: Any) -> jax.Array:
    """2-D a . b contracted over a's dim ca and b's dim cb (no transposes written out)."""
    return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), preferred_element_type=dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rowwise_dot(x: jax.Array, w: jax.Array, gw_hp: bool) -> jax.Array:
    """x (M, K) . w (K, N) in FP8 e4m3 with one scale per row of each GEMM operand (torchao's rowwise;
    ``gw_hp``: its rowwise_with_gw_hp)."""
    return _rw_fwd(x, w, gw_hp)[0]


def _rw_fwd(x: jax.Array, w: jax.Array, gw_hp: bool) -> tuple[jax.Array, Any]:
    qx, sx = _q(x, E4M3, 1, not gw_hp)  # (M, 1): per row of x
    qw, sw = _q(w, E4M3, 0, not gw_hp)  # (1, N): per output column of w
    return fp8_ops.dequantize(_mm(qx, qw, 1, 0, x.dtype), x.dtype, sx * sw), (x, w)


def _rw_bwd(gw_hp: bool, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    pow2 = not gw_hp
    # dx = g . w^T, contracted over N: g per row; w per row (rowwise) or per tensor (gw_hp)
    qg, sg = _q(g, E4M3, 1, pow2)
    qw, sw = _q(w, E4M3, None if gw_hp else 1, pow2)
    dx = fp8_ops.dequantize(_mm(qg, qw, 1, 1, x.dtype), x.dtype, sg * sw.reshape(1, -1))
    # dw = x^T . g, contracted over M: x and g per column (rowwise), or unquantized in bf16 (gw_hp)
    if gw_hp:
        dw = _mm(x, g.astype(x.dtype), 0, 0, x.dtype)
    else:
        qx, sx = _q(x, E4M3, 0, True)
        qg, sg = _q(g, E4M3, 0, True)
        dw = fp8_ops.dequantize(_mm(qx, qg, 0, 0, x.dtype), x.dtype, sx.reshape(-1, 1) * sg)
    return dx, dw.astype(w.dtype)


rowwise_dot.defvjp(_rw_fwd, _rw_bwd)


class NativeFp8Linear(nnx.Module):
    """A bf16 Linear whose matmul is an FP8 dot (hand-written with flax.linen.fp8_ops)."""

    def __init__(self, din: int, dout: int, recipe: str, rngs: nnx.Rngs) -> None:
        init = nnx.Linear(din, dout, rngs=rngs)  # the same init as nnx.Linear (and as the other variants)
        self.kernel, self.bias = nnx.Param(init.kernel[...]), nnx.Param(init.bias[...])
        self.recipe = recipe
        if recipe == "delayed":
            for name in ("input_scale", "kernel_scale", "output_grad_scale"):
                setattr(self, name, Fp8Var(jnp.ones((1,), jnp.float32)))
            for name in ("input_amax_history", "kernel_amax_history", "output_grad_amax_history"):
                setattr(self, name, Fp8Var(jnp.zeros((HISTORY,), jnp.float32)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x, k = x.astype(jnp.bfloat16), self.kernel[...].astype(jnp.bfloat16)
        dn = (((x.ndim - 1,), (0,)), ((), ()))
        if self.recipe == "tensorwise":
            y = tensorwise_dot(x, k, dn)
        elif self.recipe in ("rowwise", "rowwise_gw_hp"):  # one row per token
            y = rowwise_dot(x.reshape(-1, x.shape[-1]), k, self.recipe == "rowwise_gw_hp")
            y = y.reshape(*x.shape[:-1], k.shape[-1])
        else:
            y = fp8_ops.fp8_scaled_dot_general(
                x, k, dn, preferred_element_type=jnp.bfloat16, quantize_compute_type=jnp.bfloat16,
                lhs_scale=self.input_scale[...], rhs_scale=self.kernel_scale[...],
                grad_scale=self.output_grad_scale[...], lhs_amax_history=self.input_amax_history[...],
                rhs_amax_history=self.kernel_amax_history[...],
                grad_amax_history=self.output_grad_amax_history[...])
        return y + self.bias[...].astype(jnp.bfloat16)


# ---------------------------------------------------------------------- the model
def linear(din: int, dout: int, kind: str, rngs: nnx.Rngs) -> nnx.Module:
    """kind: fp32 (unimp builds on it), bf16 (native mixed precision), or a native FP8 recipe."""
    if kind in RECIPES:
        return NativeFp8Linear(din, dout, kind, rngs)
    return nnx.Linear(din, dout, dtype=jnp.bfloat16 if kind == "bf16" else None, rngs=rngs)


class Block(nnx.Module):
    """Pre-LN GPT block: x + attn(ln1(x)), then x + fc2(gelu(fc1(ln2(x)))) (4x MLP)."""

    def __init__(self, d: int, heads: int, kind: str, impl: str | None, rngs: nnx.Rngs) -> None:
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv, self.out = linear(d, 3 * d, kind, rngs), linear(d, d, kind, rngs)
        self.fc1, self.fc2 = linear(d, 4 * d, kind, rngs), linear(4 * d, d, kind, rngs)
        self.heads, self.impl = heads, impl

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).reshape(b, t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        impl = self.impl if q.dtype in (jnp.bfloat16, jnp.float16) else None
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        x = x + self.out(y.reshape(b, t, d)).astype(x.dtype)
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x)))).astype(x.dtype)


class LM(nnx.Module):
    def __init__(self, c: CurveConfig, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(c.vocab, c.d, rngs=rngs)
        self.blocks = getattr(nnx, "List", list)([Block(c.d, c.heads, "fp32", None, rngs) for _ in range(c.layers)])
        self.ln_f = nnx.LayerNorm(c.d, rngs=rngs)
        self.head = nnx.Linear(c.d, c.vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------------- steps
def block_loss(model: Any, x: jax.Array, target: jax.Array) -> jax.Array:
    return jnp.mean((model(x).astype(jnp.float32) - target) ** 2)


def jitted(model: Any, optimizer: Any, grad_fn: Any, write_fp8: bool = False) -> tuple[Any, Any]:
    """A pure jitted step over the split (model, optimizer) state, donated: (step, state)."""
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state: Any, x: jax.Array, target: jax.Array) -> tuple[Any, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, optimizer, x, target)
        optimizer.update(model, grads)
        if write_fp8:  # native delayed: the scaling Variables take their "gradients" (new values)
            nnx.update(model, nnx.state(grads, Fp8Var))
        return nnx.state((model, optimizer)), loss

    return step, state


def parse(variant: str) -> tuple[str, str]:
    """(side, recipe) of a variant name: bf16 -> (bf16, ""), native_<r>[_b] -> (native, r), unimp_<r> -> (unimp, r)."""
    side, _, rest = variant.partition("_")
    if side != "bf16" and rest not in RECIPES:
        rest = rest.removesuffix("_b")  # the A/A control
    if side not in ("bf16", "native", "unimp") or (side != "bf16" and rest not in RECIPES):
        raise ValueError(f"unknown variant {variant!r}")
    return side, rest


def build(variant: str, cfg: Config, impl: str | None) -> tuple[Any, Any, Any]:
    tx = optax.adamw(1e-4)
    side, recipe = parse(variant)
    kind = recipe if side == "native" else "bf16"
    if side in ("bf16", "native"):
        model = Block(cfg.d, cfg.heads, kind, impl, nnx.Rngs(0))
        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, Fp8Var))
        grad = lambda m, o, x, t: nnx.value_and_grad(block_loss, argnums=wrt)(m, x, t)
        return (*jitted(model, nnx.Optimizer(model, tx, wrt=nnx.Param), grad, kind == "delayed"), None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.UnimpWarning)  # bf16/FP8 emulated on CPU: known
        amp = unimp.apply(POLICIES[recipe], Block(cfg.d, cfg.heads, "fp32", impl, nnx.Rngs(0)), tx)
    vg = amp.value_and_grad(block_loss)

    def grad(m: Any, o: Any, x: jax.Array, t: jax.Array) -> tuple[Any, Any]:
        loss, grads, _ = vg(o, m, x, t)
        return loss, grads

    return (*jitted(amp.model, amp.optimizer, grad), amp)


def fp8_dots(lowered_text: str) -> int:
    """How many dot_generals of the lowered step take float8 operands."""
    return sum(1 for line in lowered_text.splitlines() if "dot_general" in line and "xf8E" in line)


def gemm_kinds(compiled_text: str) -> dict[str, int]:
    """How the compiled step runs its GEMMs: library calls by target (cuBLAS / cuBLASLt FP8 / cuDNN on
    GPU), Triton GEMM fusions, and dots left to the compiler's own emitter (``dot(`` instructions)."""
    kinds: dict[str, int] = {}
    for line in compiled_text.splitlines():
        if "custom-call(" in line and 'custom_call_target="' in line:
            target = line.split('custom_call_target="', 1)[1].split('"', 1)[0]
            if any(k in target for k in ("cublas", "cudnn", "gemm", "matmul")):
                kinds[target] = kinds.get(target, 0) + 1
        elif "__triton_gemm" in line and "fusion(" in line:
            kinds["triton_gemm"] = kinds.get("triton_gemm", 0) + 1
        elif " dot(" in line:
            kinds["dot"] = kinds.get("dot", 0) + 1
    return kinds


class Phases:
    """Times a build's phases, printing each as it ends (a phase that never ends is located)."""

    def __init__(self, variant: str) -> None:
        self.variant, self.done = variant, []
        self.start = self.mark = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.done.append(f"{name} {now - self.mark:.1f}s")
        print(f"  {self.variant}: {self.done[-1]}", flush=True)
        self.mark = now

    @property
    def total(self) -> float:
        """Seconds from the start to the end of the last phase."""
        return self.mark - self.start


def speed(cfg: Config, control: bool, recipes: tuple[str, ...] = RECIPES) -> dict[str, Any]:
    on_gpu = jax.default_backend() == "gpu"
    impl = "cudnn" if on_gpu else None
    variants = ["bf16"]
    for r in recipes:
        variants += [f"native_{r}", f"unimp_{r}"] + ([f"native_{r}_b"] if control else [])
    key = jax.random.key(0)
    x = jax.random.normal(key, (cfg.batch, cfg.seq, cfg.d), jnp.float32)
    target = jax.random.normal(jax.random.fold_in(key, 1), x.shape, jnp.float32)
    steps, states, first, compile_s, dots, gemms, reports = {}, {}, {}, {}, {}, {}, {}
    for v in variants:
        phase = Phases(v)
        steps[v], states[v], amp = build(v, cfg, impl)
        phase("build")
        if amp is not None:  # before the first (donating) step
            reports[v] = [(r.path, r.fp8) for r in amp.report(x[:1, :16]).rows]
            phase("report")
        lowered = steps[v].lower(states[v], x, target)
        dots[v] = fp8_dots(lowered.as_text())
        phase("lower")
        steps[v] = lowered.compile()  # the compiled step is what runs (and is timed) from here on
        gemms[v] = gemm_kinds(steps[v].as_text())
        phase(f"compile (GEMMs: {gemms[v]})")
        states[v], loss = steps[v](states[v], x, target)
        first[v] = float(loss)
        phase("first step")
        states[v], loss = steps[v](states[v], x, target)
        jax.block_until_ready(loss)
        phase("step")
        compile_s[v] = phase.total
        print(f"built, compiled and ran twice: {v} ({compile_s[v]:.1f}s: {', '.join(phase.done)})", flush=True)
    times, rounds = interleaved(steps, states, variants, cfg.rounds, cfg.steps, x, target)
    med = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}

    def paired(a: str, b: str) -> float:
        return statistics.median(p[a] / p[b] for p in rounds)

    ratios = {}
    for r in recipes:
        ratios[f"bf16/native_{r} (FP8 speed-up)"] = paired("bf16", f"native_{r}")
        ratios[f"bf16/unimp_{r} (FP8 speed-up through unimp)"] = paired("bf16", f"unimp_{r}")
        ratios[f"unimp_{r}/native_{r}"] = paired(f"unimp_{r}", f"native_{r}")
        if control:
            ratios[f"native_{r}_b/native_{r} (A/A)"] = paired(f"native_{r}_b", f"native_{r}")
    return {"config": asdict(cfg), "attention": impl or "xla", "median_ms": med, "ratios": ratios,
            "first_loss": first, "compile_s": compile_s, "fp8_dots_in_step": dots, "compiled_gemms": gemms,
            "steps_timed": {v: len(ts) for v, ts in times.items()}, "round_medians_ms": rounds,
            "unimp_fp8_layers": reports}


# ---------------------------------------------------------------------- curve
def corpus(c: CurveConfig, seed: int = 0) -> np.ndarray:
    """``steps`` batches of a seeded sparse bigram language (4 likely successors per token)."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, c.vocab, (c.vocab, 4))
    n = c.steps * c.batch
    out = np.empty((n, c.seq + 1), np.int32)
    out[:, 0] = rng.integers(0, c.vocab, n)
    pick = rng.integers(0, 4, (n, c.seq))
    noise = rng.random((n, c.seq)) < 0.1
    rand = rng.integers(0, c.vocab, (n, c.seq))
    for t in range(c.seq):
        nxt = succ[out[:, t], pick[:, t]]
        out[:, t + 1] = np.where(noise[:, t], rand[:, t], nxt)
    return out.reshape(c.steps, c.batch, c.seq + 1)


def lm_loss(model: Any, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def curve(c: CurveConfig, recipes: tuple[str, ...] = RECIPES) -> dict[str, Any]:
    data = corpus(c)
    out: dict[str, Any] = {"config": asdict(c), "losses": {}, "final": {}}
    runs = {"mixed_bf16": "mixed_bf16", **{f"fp8_{r}": POLICIES[r] for r in recipes}}
    for policy, source in runs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", unimp.UnimpWarning)
            amp = unimp.apply(source, LM(c, nnx.Rngs(0)), optax.adamw(c.lr))
        vg = amp.value_and_grad(lm_loss)

        def grad(m: Any, o: Any, tokens: jax.Array, _: Any, vg: Any = vg) -> tuple[Any, Any]:
            loss, grads, _ = vg(o, m, tokens)
            return loss, grads

        step, state = jitted(amp.model, amp.optimizer, grad)
        logged, window = [], []
        for i in range(c.steps):
            state, loss = step(state, jnp.asarray(data[i]), None)
            window.append(loss)
            if (i + 1) % c.every == 0 or i + 1 == c.steps:
                logged.append((i + 1, float(np.mean(jax.device_get(window)))))  # mean over the window
                window = []
        out["losses"][policy] = logged
        out["final"][policy] = logged[-1][1]
    base = out["final"]["mixed_bf16"]
    out["final_ratio_over_bf16"] = {p: v / base for p, v in out["final"].items()}
    return out


# ---------------------------------------------------------------------- output
def speed_table(res: dict[str, Any]) -> str:
    cfg = res["config"]
    rows = ["| variant | ms/step (median) | FP8 dots in the step | compiled GEMMs | first loss | build s |",
            "|---|---:|---:|---|---:|---:|"]
    for v, ms in res["median_ms"].items():
        gemms = ", ".join(f"{k} {n}" for k, n in sorted(res["compiled_gemms"][v].items()))
        rows.append(f"| {v} | {ms:.2f} | {res['fp8_dots_in_step'][v]} | {gemms} | {res['first_loss'][v]:.5f} "
                    f"| {res['compile_s'][v]:.1f} |")
    head = (f"GPT block d={cfg['d']} heads={cfg['heads']} T={cfg['seq']} batch={cfg['batch']}, attention "
            f"{res['attention']}, {res['steps_timed']['bf16']} timed steps per variant\n\n")
    ratios = ["| ratio (median of per-round ratios) | value |", "|---|---:|"]
    ratios += [f"| {k} | {v:.3f} |" for k, v in res["ratios"].items()]
    return head + "\n".join(rows) + "\n\n" + "\n".join(ratios) + "\n"


def curve_table(res: dict[str, Any]) -> str:
    policies = list(res["losses"])
    rows = ["| step | " + " | ".join(policies) + " |", "|---:|" + "---:|" * len(policies)]
    for i, (step, _) in enumerate(res["losses"][policies[0]]):
        rows.append(f"| {step} | " + " | ".join(f"{res['losses'][p][i][1]:.4f}" for p in policies) + " |")
    ratio = ", ".join(f"{p}: {r:.4f}" for p, r in res["final_ratio_over_bf16"].items() if p != "mixed_bf16")
    c = res["config"]
    return (f"LM d={c['d']} layers={c['layers']} T={c['seq']} batch={c['batch']} vocab={c['vocab']}, "
            f"{c['steps']} steps (loss: mean over each {c['every']}-step window)\n\n" + "\n".join(rows)
            + f"\n\nfinal loss / bf16: {ratio}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--gpu", action="store_true", help="the H200 config (d=4096, T=2048, batch 8)")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes: tests the script in seconds on CPU")
    for name in ("d", "heads", "seq", "batch", "rounds", "steps"):
        parser.add_argument(f"--{name}", type=int, help=f"override the speed config's {name}")
    parser.add_argument("--control", action="store_true", help="add native_<recipe>_b (A/A control)")
    parser.add_argument("--recipes", default=",".join(RECIPES),
                        help=f"comma-separated FP8 recipes to run, speed and curve (default: {','.join(RECIPES)})")
    parser.add_argument("--no-speed", action="store_true", help="skip the speed comparison")
    parser.add_argument("--curve", action="store_true", help="also run the training curve")
    parser.add_argument("--curve-steps", type=int, help="curve steps (default 300; smoke 30)")
    parser.add_argument("--curve-every", type=int, help="log the loss every N steps (default 25; smoke 10)")
    parser.add_argument("--out", type=Path, help="directory for fp8_jax.json")
    args = parser.parse_args(argv)
    recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        parser.error(f"--recipes: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(RECIPES)}")
    cfg = CONFIGS["gpu" if args.gpu else "smoke" if args.smoke else "cpu"]
    cfg = replace(cfg, **{k: getattr(args, k) for k in ("d", "heads", "seq", "batch", "rounds", "steps")
                          if getattr(args, k) is not None})
    res: dict[str, Any] = {"jax": jax.__version__, "device": str(jax.devices()[0]),
                           "backend": jax.default_backend(), "python": platform.python_version()}
    print(f"JAX {res['jax']} on {res['device']} ({res['backend']})\n")
    if not args.no_speed:
        res["speed"] = speed(cfg, args.control, recipes)
        print(speed_table(res["speed"]))
    if args.curve:
        c = CurveConfig(d=32, heads=2, layers=1, seq=16, batch=4, vocab=64, steps=30, every=10) if args.smoke \
            else CurveConfig()
        c = replace(c, **{k: v for k, v in (("steps", args.curve_steps), ("every", args.curve_every)) if v})
        res["curve"] = curve(c, recipes)
        print(curve_table(res["curve"]))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_jax.json").write_text(json.dumps(res, indent=1))
        print(f"wrote {args.out / 'fp8_jax.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
