"""Layer-level control: per-module forwards for overrides (module globs, layer types).

A module gets a wrapper only when it must: an override that sets its compute dtype (ops a policy moves are handled per
call by :mod:`unimp_torch.op_overrides`). Every other module runs untouched. The casts are :mod:`unimp_torch.casts`'.

>>> import torch
>>> layer = torch.nn.Linear(4, 4)
>>> undo = wrap(layer, Rule("float32"), "cpu")
>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     layer(torch.randn(2, 4)).dtype
torch.float32
>>> undo()
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .casts import DTYPES, autocast_to, cast, first_float, params_as, widest
from .kinds import kind


@dataclass(frozen=True)
class Rule:
    """How a wrapped module computes: a dtype name, ``inputs`` (its input's) or ``promote``."""

    dtype: str
    composite: bool = False  # a module with children and a low dtype: autocast to it, children decide


def _target(rule: Rule, module: nn.Module, args: tuple, kwargs: dict) -> torch.dtype | None:
    if rule.dtype in DTYPES:
        return DTYPES[rule.dtype]
    first = first_float((*args, *kwargs.values()))
    if rule.dtype == "inputs" or first is None:
        return first
    return widest((*args, *kwargs.values(), *module.parameters()))  # promote: the inputs' and the params'


class LayerForward:
    """``module.forward`` computing as ``rule`` says (an object, not a closure: copies and pickles
    of the model run their own layer; ``torch.compile`` traces it)."""

    def __init__(self, module: nn.Module, inner: Callable | None, rule: Rule, device: str) -> None:
        self.module = module
        self.inner = inner  # the instance forward that was there before, else None (the class's)
        self.rule = rule
        self.device = device
        # BatchNorm keeps float32 weights and statistics (as under autocast): only its input is cast
        self.cast_params = kind(module) != "batch_norm"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, rule = self.module, self.rule
        inner = self.inner if self.inner is not None else functools.partial(type(module).forward, module)
        if rule.composite:
            with autocast_to(self.device, DTYPES[rule.dtype]):
                return inner(*args, **kwargs)
        dtype = _target(rule, module, args, kwargs)
        if dtype is None:
            return inner(*args, **kwargs)
        args = tuple(cast(a, dtype) for a in args)
        kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
        with torch.autocast(self.device, enabled=False):
            if not self.cast_params:
                return inner(*args, **kwargs)
            with params_as(module, dtype):
                return inner(*args, **kwargs)


def wrap(module: nn.Module, rule: Rule, device: str) -> Callable[[], None]:
    """Make ``module`` compute as ``rule`` says; returns the function that undoes it."""
    return install_forward(module, LayerForward(module, module.__dict__.get("forward"), rule, device))


def install_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Put ``forward`` on the instance; the returned undo restores exactly what was there before."""
    had_own, inner = "forward" in module.__dict__, module.__dict__.get("forward")
    with contextlib.suppress(TypeError, ValueError):  # HF Trainer reads it (remove_unused_columns)
        forward.__signature__ = inspect.signature(module.forward)  # type: ignore[attr-defined]
    module.forward = forward

    def undo() -> None:
        if had_own:
            module.forward = inner
        else:
            module.__dict__.pop("forward", None)

    return undo
