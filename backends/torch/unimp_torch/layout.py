"""Layout hints: channels_last for 2-D convolution nets, and dims misaligned for tensor cores.

>>> import torch
>>> misaligned(torch.nn.Sequential(torch.nn.Linear(16, 12)), 8)
['0: out_features=12 is not a multiple of 8']
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from unimp.spi import Layout, UnimpWarning, UnsupportedError

DIMS = {nn.Linear: ("in_features", "out_features"), nn.Embedding: ("num_embeddings", "embedding_dim"),
        nn.modules.conv._ConvNd: ("in_channels", "out_channels")}


def misaligned(model: nn.Module, align: int) -> list[str]:
    """``"path: dim=value is not a multiple of align"`` for every Linear/Conv/Embedding dim."""
    out = []
    for path, m in model.named_modules():
        for cls, dims in DIMS.items():
            if isinstance(m, cls):
                out += [f"{path or '<model>'}: {d}={getattr(m, d)} is not a multiple of {align}"
                        for d in dims if getattr(m, d) % align]
    return out


def check_alignment(model: nn.Module, layout: Layout) -> list[str]:
    """Apply ``on_misaligned``: returns the findings (warns or raises as the policy says)."""
    if layout.on_misaligned == "ignore":
        return []
    found = misaligned(model, layout.align)
    if found and layout.on_misaligned == "error":
        raise UnsupportedError(
            f"layout.on_misaligned = 'error': {len(found)} dims are not multiples of {layout.align}:\n  "
            + "\n  ".join(found) + "\nfix: pad these dims to a multiple of layout.align, lower "
            "layout.align, or set layout.on_misaligned = 'warn'")
    if found:
        warnings.warn("unimp: dims not a multiple of layout.align (slower tensor-core paths): "
                      + "; ".join(found), UnimpWarning, stacklevel=4)
    return found


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
