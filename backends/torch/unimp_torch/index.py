"""The model index the Plan is compiled from: per module path its kind, class names and tiling dims.

>>> import torch
>>> [(i.path, i.kind, i.dims) for i in model_index(torch.nn.Sequential(torch.nn.Linear(16, 12)))][1]
('0', 'linear', (('in_features', 16), ('out_features', 12)))
"""

from __future__ import annotations

from torch import nn

from unimp.spi import LayerInfo

from .kinds import kind, type_names
from .layout import dims


def model_index(model: nn.Module) -> tuple[LayerInfo, ...]:
    """Every module of ``model`` (the root as path ``""``) as the core's :class:`LayerInfo`."""
    return tuple(LayerInfo(path, kind(m), type_names(m), dims(m)) for path, m in model.named_modules())
