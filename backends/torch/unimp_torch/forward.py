"""The model's forward under the compiled plan: autocast, unimp's op rules, layout, output dtype.

With no op moves this is exactly ``with torch.autocast(device, dtype): model(x)`` plus the
policy's output cast.

>>> import torch
>>> m = torch.nn.Linear(4, 4)
>>> undo = patch_forward(m, "cpu", torch.bfloat16, {}, torch.float32, channels_last=False)
>>> m(torch.randn(2, 4)).dtype
torch.float32
>>> undo()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .layers import install_forward
from .op_overrides import active


def cast_output(out: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``out`` (nested tuples/lists/dicts) cast to ``dtype``."""
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.is_floating_point() and out.dtype != dtype else out
    if isinstance(out, tuple) and hasattr(out, "_fields"):
        return type(out)(*(cast_output(o, dtype) for o in out))
    if isinstance(out, list | tuple):
        return type(out)(cast_output(o, dtype) for o in out)
    if isinstance(out, dict):
        return type(out)((k, cast_output(v, dtype)) for k, v in out.items())
    return out


def _nhwc(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point():
        return x.contiguous(memory_format=torch.channels_last)
    return x


def patch_forward(model: nn.Module, device: str, autocast: torch.dtype | None, table: Mapping[str, str],
                  output: torch.dtype, channels_last: bool) -> Callable[[], None]:
    """Replace ``model.forward`` (on the instance); returns the undo."""
    had_own = "forward" in model.__dict__
    inner = model.forward
    table = dict(table) or None

    def run(args: tuple, kwargs: dict) -> Any:
        if autocast is None:
            return inner(*args, **kwargs)
        with torch.autocast(device, dtype=autocast):
            if table is None:
                return inner(*args, **kwargs)
            with active(table):
                return inner(*args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if channels_last:
            args = tuple(_nhwc(a) for a in args)
        return cast_output(run(args, kwargs), output)

    return install_forward(model, forward, inner, had_own)
