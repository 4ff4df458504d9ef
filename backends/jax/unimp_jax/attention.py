"""fp16 attention that runs on XLA:CPU for ``nnx.MultiHeadAttention``.

Flax nnx's default ``attention_fn`` hands dropout-free attention to ``jax.nn.dot_product_attention``,
which asks float16 inputs for the dot algorithm ``F16_F16_F32``; XLA:CPU has no such algorithm and
lowering fails (``The precision 'F16_F16_F32' is not supported by dot_general on CPU``) — JAX's own
try/except fallback cannot catch an error raised at lowering under ``jit``. When a layer runs in
float16 on CPU, unimp swaps in :func:`attention` for that call: the same math as JAX's XLA
implementation (float16 q/k/v, float32 logits and softmax, float16 probabilities and output) with
the default dot precision, which XLA:CPU runs.

>>> import jax.numpy as jnp
>>> q = jnp.ones((1, 4, 2, 8), jnp.float16)
>>> out = attention(q, q, q, dtype=jnp.float16, is_causal=True)
>>> out.dtype, out.shape
(dtype('float16'), (1, 4, 2, 8))
"""

from __future__ import annotations

import math
from typing import Any


def needs_cpu_attention(module: Any, compute_dtype: str | None) -> bool:
    """Whether ``module`` (an attention layer about to run in ``compute_dtype``) needs :func:`attention`."""
    if compute_dtype != "float16":
        return False
    from flax.nnx.nn import attention as nnx_attention

    if module.__dict__.get("attention_fn") is not nnx_attention.dot_product_attention:
        return False
    from .hardware import platform_of

    return platform_of()[0] == "cpu"


def attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
              dropout_rate: float = 0.0, module: Any = None, is_causal: bool = False,
              dtype: Any = None, **kwargs: Any) -> Any:
    """Drop-in for ``flax.nnx.dot_product_attention`` (``[batch..., length, heads, depth]``)."""
    import jax
    import jax.numpy as jnp
    from flax.nnx.nn import attention as nnx_attention

    if dropout_rate != 0.0 or module is not None:  # flax's own einsum path: no explicit dot algorithm
        return nnx_attention.dot_product_attention(query, key, value, bias, mask, dropout_rate=dropout_rate,
                                                   module=module, is_causal=is_causal, dtype=dtype, **kwargs)
    query, key, value = kwargs.get("promote_dtype", nnx_attention.dtypes.promote_dtype)(
        (query, key, value), dtype=dtype)
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, preferred_element_type=jnp.float32)
    logits = logits * jnp.float32(1.0 / math.sqrt(query.shape[-1]))
    if bias is not None:
        logits = (logits + bias).astype(logits.dtype)
    keep = None if mask is None else mask.astype(bool)
    if is_causal:
        t, s = logits.shape[-2], logits.shape[-1]
        causal = jnp.tril(jnp.ones((t, s), bool))
        keep = causal if keep is None else jnp.logical_and(keep, causal)
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.float32(-0.7 * float(jnp.finfo(jnp.float32).max)))
    probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", probs, value)
