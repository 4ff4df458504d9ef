"""Layer-level control: per-module forwards for overrides (module globs, layer types).

A module gets a wrapper only when it must: an override that sets its compute dtype (ops a
policy moves are handled per call by :mod:`unimp_torch.op_overrides`). Every other module runs
untouched.

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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unimp.spi import Plan, PlanRequest, dtypes, ops

from .kinds import extra_kind
from .ops import NATIVE_OPS

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
NAMES = {v: dtypes.dtype_name(v) for v in DTYPES.values()}


def output_cast(plan: Plan | PlanRequest) -> torch.dtype | None:
    """The torch dtype the model's outputs are cast to under ``plan`` (or a request); None for ``output_dtype =
    "unchanged"`` (as ``torch.autocast`` leaves them)."""
    return DTYPES[plan.output_cast] if plan.output_cast else None


def type_names(module: nn.Module) -> tuple[str, ...]:
    """Class names of ``module`` and its bases up to ``nn.Module`` (for kinds and overrides)."""
    return ops.class_names(type(module), stop=(nn.Module,))


def kind(module: nn.Module) -> str | None:
    """The canonical op of a layer (``Linear`` -> ``linear``; subclasses count as their base;
    third-party leaf layers such as HF ``LlamaRMSNorm`` through :mod:`unimp_torch.kinds`)."""
    return ops.kind_of_names(type_names(module), NATIVE_OPS) or extra_kind(module)


@dataclass(frozen=True)
class Rule:
    """How a wrapped module computes: a dtype name, ``inputs`` (its input's) or ``promote``."""

    dtype: str
    composite: bool = False  # a module with children and a low dtype: autocast to it, children decide


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _first_float(args: tuple, kwargs: dict) -> Any:
    for a in (*args, *kwargs.values()):
        if _floating(a):
            return a.dtype
    return None


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _floating(x) and x.dtype != dtype:
        return x.to(dtype)
    if isinstance(x, list | tuple) and x and any(_floating(t) for t in x):
        return type(x)(_cast(t, dtype) for t in x)
    return x


@contextlib.contextmanager
def params_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Run ``module`` with its floating params cast to ``dtype`` (differentiably; restored after)."""
    swapped = [(m, n, p) for m in module.modules() for n, p in m._parameters.items()
               if p is not None and _floating(p) and p.dtype != dtype]
    cast: dict[int, torch.Tensor] = {}  # a tied parameter is cast once (one gradient, summed in float32)
    for m, n, p in swapped:
        m._parameters[n] = cast[id(p)] if id(p) in cast else cast.setdefault(id(p), p.to(dtype))
    try:
        yield
    finally:
        for m, n, p in swapped:
            m._parameters[n] = p


def _target(rule: Rule, module: nn.Module, args: tuple, kwargs: dict) -> torch.dtype | None:
    if rule.dtype in DTYPES:
        return DTYPES[rule.dtype]
    first = _first_float(args, kwargs)
    if rule.dtype == "inputs" or first is None:
        return first
    out = first  # promote: widest of the float inputs and the params
    for t in (*args, *kwargs.values(), *module.parameters()):
        if _floating(t):
            out = torch.promote_types(out, t.dtype)
    return out


class LayerForward:
    """``module.forward`` computing as ``rule`` says (an object, not a closure: copies and pickles
    of the model run their own layer; ``torch.compile`` traces it)."""

    def __init__(self, module: nn.Module, inner: Callable | None, rule: Rule, device: str) -> None:
        self.module = module
        self.inner = inner  # the instance forward that was there before, else None (the class's)
        self.rule = rule
        self.device = device
        # BatchNorm keeps float32 weights and running statistics (torch's kernels take low
        # activations with them, as under autocast): only its input is cast
        self.cast_params = kind(module) != "batch_norm"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, rule = self.module, self.rule
        inner = self.inner if self.inner is not None else functools.partial(type(module).forward, module)
        if rule.composite:
            with torch.autocast(self.device, dtype=DTYPES[rule.dtype], cache_enabled=False):  # forward.autocast_to
                return inner(*args, **kwargs)
        dtype = _target(rule, module, args, kwargs)
        if dtype is None:
            return inner(*args, **kwargs)
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch.autocast(self.device, enabled=False):
            if not self.cast_params:
                return inner(*args, **kwargs)
            with params_as(module, dtype):
                return inner(*args, **kwargs)


def wrap(module: nn.Module, rule: Rule, device: str) -> Callable[[], None]:
    """Make ``module`` compute as ``rule`` says; returns the function that undoes it."""
    had_own = "forward" in module.__dict__
    inner = module.__dict__.get("forward")
    return install_forward(module, LayerForward(module, inner, rule, device), inner, had_own)


def install_forward(module: nn.Module, forward: Callable, inner: Callable | None,
                    had_own: bool) -> Callable[[], None]:
    """Put ``forward`` on the instance; the returned undo restores exactly what was there before."""
    with contextlib.suppress(TypeError, ValueError):  # HF Trainer reads it (remove_unused_columns)
        forward.__signature__ = inspect.signature(module.forward)  # type: ignore[attr-defined]
    module.forward = forward

    def undo() -> None:
        if had_own:
            module.forward = inner
        else:
            module.__dict__.pop("forward", None)

    return undo
