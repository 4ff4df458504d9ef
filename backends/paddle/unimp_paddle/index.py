"""The model index of a ``paddle.nn.Layer`` (one ``LayerInfo`` per sublayer: path, kind, class, tiling dims)
and its layout facts (what ``layout.channels_last`` can do; the alignment action is the core's).

>>> import paddle
>>> model_index(paddle.nn.Linear(16, 30))
(LayerInfo(path='', kind='linear', type_names=('Linear',), dims=(('in_features', 16), ('out_features', 30))),)
"""

from __future__ import annotations

from typing import Any

from unimp.spi import LayerInfo

from .ops import canonical_of


def layer_kind(layer: Any) -> str | None:
    """The canonical op of a layer, by its class name (None: follows its inputs)."""
    return canonical_of(type(layer).__name__)


def dims(layer: Any) -> tuple[tuple[str, int], ...]:
    """The tiling dims of a Linear/Conv/Embedding layer; () for other layers."""
    name = type(layer).__name__
    if name == "Linear":
        w = layer.weight.shape
        return (("in_features", int(w[0])), ("out_features", int(w[1])))
    if name == "Embedding":
        return (("embedding_dim", int(layer.weight.shape[1])),)
    if name.startswith("Conv"):
        return (("in_channels", int(layer._in_channels)), ("out_channels", int(layer._out_channels)))
    return ()


def model_index(model: Any) -> tuple[LayerInfo, ...]:
    """The Plan's index of a ``paddle.nn.Layer``: per sublayer (the layer itself as ``""``) its path, kind,
    class name and tiling dims."""
    return tuple(LayerInfo(path, layer_kind(layer), (type(layer).__name__,), dims(layer))
                 for path, layer in model.named_sublayers(include_self=True))


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
