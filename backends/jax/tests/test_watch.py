"""``amp.watch()`` on real jitted training steps of a small GPT-style nnx model under ``mixed_fp16``.

Overflows are planted: an MLP's kernel scaled at a known step so its float16 output passes 65504 (the
forward), or a gradient amplifier layer armed at a known step (the backward). The expected layer, pass
and step are the planted ones; the statistics are checked against plain JAX on the same tensors (the
logits and their gradient, computed outside the watch), with classes from JAX's own cast to float16.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import unimp
from unimp_jax import Op


@jax.custom_vjp
def amplify(x, exponent):
    return x


def _amplify_fwd(x, exponent):
    return x, exponent


def _amplify_bwd(exponent, g):  # the gradient times 2**exponent, in its own dtype (float16: overflows)
    return (g.astype(jnp.float32) * jnp.exp2(exponent.astype(jnp.float32))).astype(g.dtype), None


amplify.defvjp(_amplify_fwd, _amplify_bwd)


class Block(nnx.Module):
    def __init__(self, d, rngs):
        self.ln_1, self.ln_2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
        self.fc, self.out = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
        self.act = Op(jax.nn.gelu)
        self.amp = Op(amplify, kind="elementwise")

    def __call__(self, x, exponent):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.ln_1(x), mask=mask)
        return x + self.amp(self.out(self.act(self.fc(self.ln_2(x)))), exponent)


class TinyGPT(nnx.Module):
    def __init__(self, rngs, vocab=64, d=32, layers=2):
        self.wte = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.ln_f, self.head = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, exponent):
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x, exponent)
        return self.head(self.ln_f(x))


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 16)))
ZERO = jnp.int32(0)


def loss_fn(model, tokens, exponent):
    logits = model(tokens, exponent).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


def setup(every, localize):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 emulated on XLA:CPU; small dims
        amp = unimp.apply("mixed_fp16", TinyGPT(nnx.Rngs(0)), optax.adam(1e-3))
    watch = amp.watch(every=every, localize=localize)
    grad_fn = amp.value_and_grad(loss_fn, numerics=True)

    @nnx.jit
    def step(model, optimizer, tokens, exponent):
        loss, grads, _finite, numerics = grad_fn(optimizer, model, tokens, exponent)
        optimizer.update(model, grads)
        return loss, numerics

    def train(steps, scale_fc_at=None, amplify_at=None):
        kernel = amp.model.blocks[1].fc.kernel
        for k in range(steps):
            if k == scale_fc_at:
                kernel.set_value(kernel.get_value() * 1e6)
            elif scale_fc_at is not None and k == scale_fc_at + 1:
                kernel.set_value(kernel.get_value() / 1e6)
            exponent = jnp.int32(40) if k == amplify_at else ZERO
            amp.record(step(amp.model, amp.optimizer, TOKENS, exponent)[1])

    return amp, watch, train


def test_overflows_are_named_with_their_layer_and_direction():
    amp, watch, train = setup(every=100, localize=True)
    train(6, scale_fc_at=2, amplify_at=4)
    watch.close()  # reads the last step's numerics
    assert amp.skipped_steps == 2
    assert [(r["step"], r["sampled"], r["skipped"]) for r in watch.records] == [
        (0, True, False), (2, False, True), (4, False, True)]
    assert [r["first_nonfinite"] for r in watch.skipped] == [
        {"path": "blocks.1.fc", "direction": "forward", "tensor": "output", "exact": True},
        # the gradient reaches the last block's amplifier first
        {"path": "blocks.1.amp", "direction": "backward", "tensor": "grad_input", "exact": True}]
    amp.remove()


def test_without_localize_a_skipped_step_is_located_from_the_loss_and_the_parameter_gradients():
    amp, watch, train = setup(every=100, localize=False)
    train(3, amplify_at=1)
    watch.close()
    (skipped,) = watch.skipped
    assert skipped["first_nonfinite"]["direction"] == "backward" and not skipped["first_nonfinite"]["exact"]
    assert skipped["first_nonfinite"]["path"] == "blocks.1.out"  # the layer feeding the planted one
    amp.remove()


def _reference(x):
    """Classes of ``x`` cast to float16 by JAX itself."""
    x = np.asarray(x)
    y = np.asarray(jnp.asarray(x).astype(jnp.float16)).astype(np.float64)
    n, finite = x.size, np.isfinite(x)
    tiny = float(jnp.finfo(jnp.float16).smallest_normal)
    return {"amax": float(np.where(finite, np.abs(x), 0).max()), "nonfinite": float((~finite).sum()) / n,
            "overflow": float((np.isinf(y) & ~np.isnan(x)).sum()) / n,
            "underflow": float(((y == 0) & (x != 0) & finite).sum()) / n,
            "subnormal": float(((y != 0) & (np.abs(y) < tiny) & np.isfinite(y)).sum()) / n,
            "zero": float((x == 0).sum()) / n, "numel": n}


def test_sampled_statistics_match_plain_jax_on_the_same_tensors():
    amp, watch, train = setup(every=2, localize=False)
    model = amp.model
    # the reference, before the step changes the weights: the logits and the gradient arriving at them
    logits = model(TOKENS, ZERO)
    scale = amp.scale
    grad = jax.grad(lambda z: optax.softmax_cross_entropy_with_integer_labels(
        z.astype(jnp.float32), TOKENS).mean() * scale)(logits)
    train(3)
    watch.close()
    assert [r["step"] for r in watch.records] == [0, 2]
    rows = {(s["path"], s["tensor"]): s for s in watch.records[0]["layers"]}
    for key, tensor in ((("head", "output"), logits), (("head", "grad_output"), grad)):
        row, ref = rows[key], _reference(tensor)
        assert row["dtype"] == "float16"
        for stat, value in ref.items():
            assert row[stat] == pytest.approx(value, rel=1e-6, abs=0), (key, stat)
    assert {("blocks.0.fc", "output"), ("blocks.0.fc", "grad_output"), ("wte", "output")} <= set(rows)
    report = amp.report(TOKENS, ZERO)
    assert report.numerics["sampled_steps"] == 2
    amp.remove()


def test_numerics_need_a_running_watch():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = unimp.apply("mixed_bf16", TinyGPT(nnx.Rngs(0)), optax.adam(1e-3))
    with pytest.raises(unimp.UnsupportedError, match="no watch is running"):
        amp.value_and_grad(loss_fn, numerics=True)
    amp.record({})  # nothing to record to: ignored
    amp.remove()


def test_linen_layers_are_named_by_their_paths():
    import flax.linen as nn

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            hidden = nn.Dense(32, name="fc")(x)
            return nn.Dense(4, name="head")(nn.relu(hidden))

    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)), jnp.float32)
    module = Mlp()
    params = module.init(jax.random.PRNGKey(0), x)["params"]
    policy = {"name": "fp16_scale_1", "extends": "mixed_fp16", "loss_scale": {"initial": 1.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp = unimp.apply(policy, module, optax.sgd(1e-3), params=params, inputs=x)
    watch = amp.watch(every=100, localize=True)
    grad_fn = amp.value_and_grad(lambda p, x: (amp.apply(p, x).astype(jnp.float32) ** 2).mean(), numerics=True)

    @jax.jit
    def step(params, opt_state, x):
        _, grads, _, numerics = grad_fn(opt_state, params, x)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state, numerics

    p, s = amp.params, amp.opt_state
    def scaled(path, v):  # fc's kernel x1e6: its float16 output overflows
        return v * 1e6 if "fc" in str(path) and "kernel" in str(path) else v

    for k in range(3):
        planted = jax.tree_util.tree_map_with_path(scaled, p) if k == 1 else p
        new_p, s, numerics = step(planted, s, x)
        p = new_p if k != 1 else p  # the skipped step changed nothing; keep the unplanted params
        amp.record(numerics)
    watch.close()
    assert [(r["step"], r["skipped"]) for r in watch.records] == [(0, False), (1, True)]
    assert watch.skipped[0]["first_nonfinite"] == {"path": "fc", "direction": "forward", "tensor": "output",
                                                   "exact": True}
    assert [(s["path"], s["tensor"]) for s in watch.records[0]["layers"]] == [
        ("fc", "output"), ("head", "output"), ("head", "grad_output"), ("fc", "grad_output")]
