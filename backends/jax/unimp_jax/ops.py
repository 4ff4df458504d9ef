"""The native names of Flax for each canonical op: flax.linen / flax.nnx module classes and the jax.nn /
jax.numpy functions :class:`unimp_jax.Op` wraps. The backend declares this table (``JaxBackend.native_ops``).

>>> NATIVE_OPS["linear"]
('Dense', 'DenseGeneral', 'Linear', 'LinearGeneral')
"""

from __future__ import annotations

NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("Einsum",),
    "linear": ("Dense", "DenseGeneral", "Linear", "LinearGeneral"),
    "conv": ("Conv", "ConvTranspose", "ConvLocal"),
    "attention": ("MultiHeadAttention", "MultiHeadDotProductAttention", "SelfAttention"),
    "rnn": ("LSTMCell", "GRUCell", "OptimizedLSTMCell", "RNN"),
    "embedding": ("Embed",),
    "softmax": ("softmax",),
    "log_softmax": ("log_softmax",),
    "layer_norm": ("LayerNorm",),
    "rms_norm": ("RMSNorm",),
    "batch_norm": ("BatchNorm",),
    "group_norm": ("GroupNorm", "InstanceNorm"),
    "activation": ("relu", "gelu", "silu", "tanh", "sigmoid"),
    "transcendental": ("exp", "log", "power", "rsqrt"),
    "reduction": ("sum", "mean"),
}
