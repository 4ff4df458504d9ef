"""Layout hints: channels_last for 2-D convolution nets, and dims misaligned for tensor cores.

>>> import torch
>>> dims(torch.nn.Linear(16, 12))
(('in_features', 16), ('out_features', 12))
"""

from __future__ import annotations

import torch
from torch import nn

DIMS = {nn.Linear: ("in_features", "out_features"), nn.Embedding: ("num_embeddings", "embedding_dim"),
        nn.modules.conv._ConvNd: ("in_channels", "out_channels")}


def dims(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """The tiling dims of a Linear/Conv/Embedding (what ``layout.align`` checks); () for other modules."""
    return tuple((d, int(getattr(module, d))) for cls, names in DIMS.items() if isinstance(module, cls)
                 for d in names)


def has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d | nn.ConvTranspose2d) for m in model.modules())


def to_channels_last(model: nn.Module) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
    """Convert 4-D params/buffers to channels_last in place; returns what restore needs (their strides)."""
    seen = [(t, t.stride()) for t in (*model.parameters(), *model.buffers()) if t.dim() == 4]
    model.to(memory_format=torch.channels_last)
    return seen


def restore_layout(seen: list[tuple[torch.Tensor, tuple[int, ...]]]) -> None:
    """Give every tensor back its exact strides (``is_contiguous()`` alone cannot tell a 1x1 conv
    weight in channels_last from a contiguous one, and kernels pick different paths for them)."""
    for t, stride in seen:
        if t.stride() != stride:
            with torch.no_grad():
                t.data = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t.data)
