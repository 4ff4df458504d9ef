"""The model index: each layer of a model as plain data (path, canonical kind, class names, dims).

>>> import numpy as np
>>> from unimp_numpy import nn
>>> [i.kind for i in model_index(nn.Model([("fc", nn.Linear(np.ones((4, 8)), np.zeros(8)))]))]
['linear']
"""

from __future__ import annotations

from typing import Any

from unimp.spi import LayerInfo, ops

from .ops import NATIVE_OPS

NATIVE = ops.native_table("numpy", NATIVE_OPS)


def model_index(model: Any) -> tuple[LayerInfo, ...]:
    """The model's layers as the Plan's index: path, canonical kind, class names, tiling dims."""
    from .nn import Layer

    out = []
    for path, layer in model.layers:
        names = ops.class_names(type(layer), stop=(Layer,))
        out.append(LayerInfo(path, ops.kind_of_names(names, NATIVE), names, layer.dim_values()))
    return tuple(out)
