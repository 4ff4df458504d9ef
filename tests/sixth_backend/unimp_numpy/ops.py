"""The native op names of unimp_numpy.nn: canonical op -> layer class names (the backend's own table)."""

from __future__ import annotations

NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "embedding": ("Embedding",),
    "linear": ("Linear",),
    "conv": ("Conv1d",),
    "activation": ("ReLU",),
    "layer_norm": ("LayerNorm",),
    "log_softmax": ("LogSoftmax",),
}
