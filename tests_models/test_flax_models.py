"""Flax nnx MiniGPT and a linen CNN (as Flax's examples write them) under every JAX preset."""

import functools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx, serialization
from flax.nnx.nn import attention as nnx_attention
from tolerance import reference_tolerance

import unimp

STEPS = 10
# preset -> the layers' `dtype` in Flax's own mixed precision, written by hand. fp32 must be bit-identical over
# the whole run; the low-precision presets are compared step by step at the same weights (reference_tolerance):
# a 10-step trajectory amplifies rounding differences chaotically, by an amount that depends on the CPU.
NATIVE = {"fp32": jnp.float32, "mixed_bf16": jnp.bfloat16, "pure_bf16": jnp.bfloat16, "mixed_fp16": jnp.float16,
          "fp16_master": jnp.float16, "jmp_float16": jnp.float16, "flax_dynamic_scale": jnp.float16}


def as_float32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


TOKENS = jax.random.randint(jax.random.key(0), (4, 17), 0, 64)
IMAGES = jax.random.normal(jax.random.key(1), (8, 16, 16, 1))
LABELS = jax.random.randint(jax.random.key(2), (8,), 0, 10)


def einsum_attention(query, key, value, mask=None, dtype=None, **kwargs):
    """Flax's own unfused attention (dot_product_attention_weights + einsum).

    The hand-written float16 reference needs it on XLA:CPU: Flax's default hands dropout-free
    attention to jax.nn.dot_product_attention, whose float16 dot algorithm XLA:CPU cannot lower.
    """
    weights = nnx_attention.dot_product_attention_weights(query, key, mask=mask, dtype=dtype)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value)


class TransformerBlock(nnx.Module):
    def __init__(self, dim, heads, ff, rngs, dtype=None):
        extra = {"attention_fn": einsum_attention} if dtype == jnp.float16 else {}
        self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, dtype=dtype,
                                                rngs=rngs, **extra)
        self.layer_norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.dense1 = nnx.Linear(dim, ff, dtype=dtype, rngs=rngs)
        self.dense2 = nnx.Linear(ff, dim, dtype=dtype, rngs=rngs)
        self.layer_norm2 = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(x[..., 0])
        x = self.layer_norm1(x + self.attention(x, mask=mask))
        return self.layer_norm2(x + self.dense2(nnx.relu(self.dense1(x))))


class MiniGPT(nnx.Module):
    def __init__(self, rngs, dtype=None, vocab=64, dim=32, maxlen=16):
        self.token_emb = nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs)
        self.pos_emb = nnx.Embed(maxlen, dim, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(dim, 2, 64, rngs, dtype) for _ in range(2)])
        self.output_layer = nnx.Linear(dim, vocab, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.token_emb(tokens) + self.pos_emb(jnp.arange(tokens.shape[1])[None])
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class CNN(linen.Module):
    dtype: object = None

    @linen.compact
    def __call__(self, x):
        x = linen.relu(linen.Conv(8, (3, 3), dtype=self.dtype)(x))
        x = linen.avg_pool(x, (2, 2), (2, 2))
        x = linen.relu(linen.Conv(16, (3, 3), dtype=self.dtype)(x))
        x = linen.avg_pool(x, (2, 2), (2, 2)).reshape((x.shape[0], -1))
        x = linen.relu(linen.Dense(32, dtype=self.dtype)(x))
        return linen.Dense(10, dtype=self.dtype)(x)


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@functools.cache
def native_nnx(dtype):
    """Losses of the hand-written run (one per dtype, shared by the presets that compare with it)."""
    model = MiniGPT(nnx.Rngs(0), dtype=dtype)  # same seed: the same initial params as the applied model
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        loss, grads = nnx.value_and_grad(lm_loss)(model, TOKENS)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt)) for _ in range(STEPS)]


def compare(c, preset, losses, want, layers=None):
    """fp32: ``want`` is Flax's own whole run, bit for bit. Otherwise ``want`` is Flax's own loss at the
    weights each of unimp's steps started from, within :func:`reference_tolerance` of ``layers``."""
    dtype = NATIVE[preset]
    assert np.isfinite(losses).all()
    name = jnp.dtype(dtype).name
    if dtype == jnp.float32:
        assert losses == want, (losses, want)
        c.check("loss", f"{STEPS} steps, bit-identical to Flax layers with dtype={name}")
    else:
        assert losses[-1] < losses[0], losses  # it trains
        tol = reference_tolerance(jnp.dtype(dtype).name, layers)
        rel = float(np.max(np.abs(np.subtract(losses, want)) / np.abs(want)))
        assert rel <= tol, (losses, want)
        c.check("loss", f"{STEPS} steps; each step's loss vs Flax layers with dtype={name} (hand-written) at the "
                        f"same weights: max rel diff {rel:.1e} (tolerance u*sqrt(layers) = {tol:.1e})")


@pytest.mark.parametrize("preset", list(NATIVE))
def test_nnx_minigpt(preset, cell):
    c = cell("flax", "nnx_minigpt", preset)
    model = MiniGPT(nnx.Rngs(0))
    params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    before = np.asarray(model(TOKENS[:, :-1]))
    amp = unimp.apply(preset, model, optax.identity())
    model(TOKENS[:, :-1])
    amp.remove()
    now = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), now))
    assert np.array_equal(before, np.asarray(model(TOKENS[:, :-1])))
    c.check("remove", "untouched model bit for bit (params, outputs)")

    amp = unimp.apply(preset, model, optax.adam(1e-3))

    @nnx.jit
    def step(model, opt):
        loss, grads, _ = amp.value_and_grad(lm_loss)(opt, model, TOKENS)
        opt.update(model, grads)
        return loss

    dtype = NATIVE[preset]
    if dtype == jnp.float32:
        losses = [float(step(amp.model, amp.optimizer)) for _ in range(STEPS)]
        compare(c, preset, losses, native_nnx(dtype))
    else:
        native = MiniGPT(nnx.Rngs(0), dtype=dtype)
        reference = nnx.jit(lambda m: lm_loss(m, TOKENS))
        losses, want = [], []
        for _ in range(STEPS):  # Flax's own loss at the weights this step starts from
            nnx.update(native, as_float32(nnx.state(amp.model, nnx.Param)))
            want.append(float(reference(native)))
            losses.append(float(step(amp.model, amp.optimizer)))
        layers = len(amp.report(TOKENS[:, :-1]).rows) - 1
        compare(c, preset, losses, want, layers)

    policy = unimp.load(preset)
    rows = {r.path: r for r in amp.report(TOKENS[:, :-1]).rows}
    attn, fc = rows["blocks.0.attention"], rows["blocks.0.dense1"]
    assert attn.compute_dtype == fc.compute_dtype == policy.compute_dtype
    assert rows["blocks.0.layer_norm1"].compute_dtype == "float32"
    c.check("report", f"attention/linear in {policy.compute_dtype}, layer_norm in float32")

    # Flax checkpoint (flax.serialization) of the applied model restores into a fresh one
    blob = serialization.to_bytes(nnx.to_pure_dict(nnx.state(amp.model, nnx.Param)))
    fresh = MiniGPT(nnx.Rngs(1))
    target = nnx.state(fresh, nnx.Param)
    nnx.replace_by_pure_dict(target, serialization.from_bytes(nnx.to_pure_dict(target), blob))
    nnx.update(fresh, target)
    applied = nnx.state(amp.model, nnx.Param)
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(applied), jax.tree.leaves(nnx.state(fresh, nnx.Param))))
    c.check("save/load", "flax.serialization round trip of the applied params")
    amp.remove()


FP8 = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise", "fp8_delayed": "delayed"}  # preset -> recipe
FP8_TOLERANCE = 2e-2  # relative, each step's loss vs Flax's bf16 layers (emulated FP8 on XLA:CPU: <= 0.7%)


@pytest.mark.parametrize("preset", list(FP8))
def test_nnx_minigpt_fp8(preset, cell):
    """The FP8 presets on Flax's MiniGPT: the Linear layers (dims multiples of 16) run scaled FP8 dots in
    the jitted step (three per layer: forward, grad input, grad weight), the losses follow Flax's own bf16
    layers written by hand, and the attention projections (LinearGeneral, no 2-D kernel) are reported
    staying in the compute dtype."""
    c = cell("flax", "nnx_minigpt", preset)
    amp = unimp.apply(preset, MiniGPT(nnx.Rngs(0)), optax.adam(1e-3))
    rows = {r.path: r for r in amp.report(TOKENS[:, :-1]).rows}
    linears = [f"blocks.{i}.{name}" for i in range(2) for name in ("dense1", "dense2")] + ["output_layer"]
    assert {p: rows[p].fp8 for p in linears} == dict.fromkeys(linears, FP8[preset])
    projections = [f"blocks.{i}.attention.{n}" for i in range(2) for n in ("query", "key", "value", "out")]
    assert not any(rows[p].fp8 for p in projections)
    c.check("report", f"{len(linears)} Linear layers in FP8 ({FP8[preset]}), attention projections in "
                      f"{unimp.load(preset).compute_dtype}")

    graphdef, state = nnx.split((amp.model, amp.optimizer))

    def pure(state):
        model, opt = nnx.merge(graphdef, state)
        loss, grads, _ = amp.value_and_grad(lm_loss)(opt, model, TOKENS)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))

    text = jax.jit(pure).lower(state).as_text()
    fp8_dots = sum(1 for line in text.splitlines() if "dot_general" in line and "xf8E" in line)
    assert fp8_dots == 3 * len(linears), fp8_dots

    @nnx.jit
    def step(model, opt):
        loss, grads, _ = amp.value_and_grad(lm_loss)(opt, model, TOKENS)
        opt.update(model, grads)
        return loss

    losses = [float(step(amp.model, amp.optimizer)) for _ in range(STEPS)]
    want = native_nnx(jnp.bfloat16)
    rel = float(np.max(np.abs(np.subtract(losses, want)) / np.abs(want)))
    assert np.isfinite(losses).all() and rel <= FP8_TOLERANCE, (losses, want)
    c.check("loss", f"{STEPS} steps vs Flax layers with dtype=bfloat16 (hand-written): max rel diff {rel:.1e} "
                    f"(tolerance {FP8_TOLERANCE:g}); {fp8_dots} FP8 dots in the jitted step")
    amp.remove()


@functools.cache
def linen_losses(dtype):
    """Flax's own mixed precision written by hand: the layers' dtype, fp32 params, plain optax."""
    module = CNN(dtype=dtype)
    params = module.init(jax.random.key(0), IMAGES)["params"]
    tx = optax.adam(1e-3)

    def loss_fn(p):
        logits = module.apply({"params": p}, IMAGES).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()

    @jax.jit
    def step(p, s):
        loss, g = jax.value_and_grad(loss_fn)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    state, out = tx.init(params), []
    for _ in range(STEPS):
        params, state, loss = step(params, state)
        out.append(float(loss))
    return out


@pytest.mark.parametrize("preset", list(NATIVE))
def test_linen_cnn(preset, cell):
    c = cell("flax", "linen_cnn", preset)
    module = CNN()
    params = module.init(jax.random.key(0), IMAGES)["params"]
    amp = unimp.apply(preset, module, optax.adam(1e-3), params=params, inputs=IMAGES)

    @jax.jit
    def step(p, opt_state):
        def loss_fn(p):
            logits = amp.apply(p, IMAGES).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()

        loss, grads, _ = amp.value_and_grad(loss_fn)(opt_state, p)
        updates, opt_state = amp.optimizer.update(grads, opt_state, p)
        return amp.apply_updates(p, updates, opt_state), opt_state, loss

    dtype, native = NATIVE[preset], CNN(dtype=NATIVE[preset])
    reference = jax.jit(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        native.apply({"params": p}, IMAGES).astype(jnp.float32), LABELS).mean())
    losses, want = [], []
    for _ in range(STEPS):
        want.append(float(reference(as_float32(amp.params))))  # Flax's own loss at this step's weights
        amp.params, amp.opt_state, loss = step(amp.params, amp.opt_state)
        losses.append(float(loss))
    if dtype == jnp.float32:
        compare(c, preset, losses, linen_losses(dtype))
    else:
        compare(c, preset, losses, want, len(amp.report(IMAGES).rows) - 1)

    # report rows vs the outputs linen itself captures (capture_intermediates)
    report = {r.path: r for r in amp.report(IMAGES).rows}
    _, inter = amp.apply(amp.params, IMAGES, capture_intermediates=True, mutable=["intermediates"])
    seen = {k: v["__call__"][0].dtype.name for k, v in inter["intermediates"].items() if k != "__call__"}
    rows = [report[p] for p in seen if p in report]
    assert rows and all(r.output_dtype == seen[r.path] for r in rows), (report, seen)
    c.check("report", f"{len(rows)} rows = linen capture_intermediates output dtypes")

    ckpt = {"params": amp.params, "opt_state": amp.opt_state}
    back = serialization.from_bytes(ckpt, serialization.to_bytes(ckpt))
    pairs = zip(jax.tree.leaves(ckpt), jax.tree.leaves(back))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    c.check("save/load", "flax.serialization round trip of params + optimizer state (masters, loss scale)")
    restored = amp.restored_params()
    assert jax.tree.map(lambda x: x.dtype, restored) == jax.tree.map(lambda x: x.dtype, params)
    c.check("remove", "module never mutated; restored_params() in the original dtypes")
