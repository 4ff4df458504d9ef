"""Bad input is a clear error naming the argument and the fix.

>>> import torch
>>> check_inputs(torch.nn.Linear(2, 2), None, None)
'cpu'
"""

from __future__ import annotations

from typing import Any

import torch

from unimp.errors import UnsupportedError


def device_of(model: Any) -> str:
    """The device type of the model's parameters (``cpu`` when it has none or no model is given)."""
    if model is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kinds = {t.device.type for t in (*model.parameters(), *model.buffers())}
    if len(kinds) > 1:
        raise UnsupportedError(f"model: parameters are on several device types {sorted(kinds)}; unimp-torch "
                               f"needs one (model.to('cuda') or model.to('cpu') before unimp.apply)")
    return kinds.pop() if kinds else "cpu"


def check_inputs(model: Any, optimizer: Any, on_skip: Any) -> str:
    """Validate ``model``/``optimizer``/``on_skip``; returns the model's device type."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}; pass the module "
                        f"itself (not its state_dict or a function)")
    device = device_of(model)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                            f"build one over model.parameters(), or pass None")
        own = {id(p) for p in model.parameters()}
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in own:
                    raise ValueError(
                        f"optimizer: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a "
                        f"parameter of this model; build the optimizer from this model's parameters, e.g. "
                        f"torch.optim.AdamW(model.parameters()), after moving the model to its device")
    if on_skip is not None and not callable(on_skip):
        raise TypeError(f"on_skip: expected a callable taking no arguments, got {type(on_skip).__name__}")
    return device
