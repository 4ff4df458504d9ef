"""Layout findings for Paddle layers: misaligned dims and what ``channels_last`` can do.

>>> import paddle, unimp
>>> model = paddle.nn.Sequential(paddle.nn.Linear(16, 30))
>>> alignment_findings(model, 8)
['0: out_features=30 is not a multiple of 8']
"""

from __future__ import annotations

from typing import Any

_DIMS = {"Linear": ("in_features", "out_features"), "Embedding": ("num_embeddings", "embedding_dim")}


def _dims(layer: Any) -> list[tuple[str, int]]:
    name = type(layer).__name__
    if name == "Linear":
        w = layer.weight.shape
        return [("in_features", w[0]), ("out_features", w[1])]
    if name == "Embedding":
        return [("embedding_dim", layer.weight.shape[1])]
    if name.startswith("Conv"):
        return [("in_channels", layer._in_channels), ("out_channels", layer._out_channels)]
    return []


def alignment_findings(model: Any, align: int) -> list[str]:
    """'path: dim=value is not a multiple of align' for every Linear/Conv/Embedding dim."""
    out = []
    for path, layer in model.named_sublayers(include_self=True):
        for dim, value in _dims(layer):
            if value % align:
                out.append(f"{path or '<model>'}: {dim}={value} is not a multiple of {align}")
    return out


def channels_last_findings(model: Any) -> list[str]:
    """What ``layout.channels_last`` means for each Conv/BatchNorm layer (reported, not rewritten)."""
    out = []
    for path, layer in model.named_sublayers(include_self=True):
        fmt = getattr(layer, "_data_format", None)
        if fmt is None or not type(layer).__name__.startswith(("Conv", "BatchNorm")):
            continue
        if fmt in ("NHWC", "NLC", "NDHWC"):
            out.append(f"{path}: channels_last: already {fmt}")
        else:
            out.append(f"{path}: channels_last: not applied ({fmt}); unimp-paddle does not rewrite "
                       f"data_format of built layers (weights and callers' input layout would change); "
                       f"build the layer with data_format='NHWC'/'NLC'")
    return out
