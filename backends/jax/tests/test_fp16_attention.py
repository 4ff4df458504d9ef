"""Explicit float16 on XLA:CPU: nnx.MultiHeadAttention runs (JAX's F16_F16_F32 dot algorithm does not lower there)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import unimp
from unimp.dtypes import reference_tolerance


class Attn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32, decode=False, rngs=rngs)
        self.head = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        return self.head(self.attn(h, mask=nnx.make_causal_mask(x)))


def _loss(model, x):
    logits = model(x[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the XLA:CPU dot-algorithm gap")
def test_mixed_fp16_multihead_attention_trains_on_cpu():
    model = Attn(nnx.Rngs(0))
    amp = unimp.apply("mixed_fp16", model, optax.adam(1e-2))
    x = jax.random.randint(jax.random.key(1), (4, 9), 0, 64)

    @nnx.jit
    def step(model, opt, x):
        loss, grads, finite = amp.value_and_grad(_loss)(opt, model, x)
        opt.update(model, grads)
        return loss, finite

    losses = [float(step(amp.model, amp.optimizer, x)[0]) for _ in range(10)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert amp.report().row("attn").compute_dtype == "float16"


def test_cpu_attention_matches_jax_attention_semantics():
    """float16 q/k/v, float32 logits and softmax: equal to JAX's attention on the same values in float32."""
    from unimp_jax.attention import attention

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 6, 2, 8)).astype(jnp.float16) for kk in (k1, k2, k3))
    mask = jnp.tril(jnp.ones((6, 6), bool))[None, None]
    want = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                        mask=mask)
    got = attention(q, k, v, mask=mask, dtype=jnp.float16)
    assert got.dtype == jnp.float16
    # two float16 products (q.k, p.v) rounded against float32: within u_fp16*sqrt(2), relative, norm-wise
    got32, want = np.asarray(got, np.float32), np.asarray(want)
    rel = np.linalg.norm(got32 - want) / np.linalg.norm(want)
    assert rel <= reference_tolerance("float16", 2), rel
    causal = attention(q, k, v, is_causal=True, dtype=jnp.float16)
    np.testing.assert_array_equal(np.asarray(causal), np.asarray(got))
