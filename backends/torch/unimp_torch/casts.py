"""The cast a policy asks of one call: a category or dtype -> the dtype that runs, and the casts to it.

Written once for the forward, a layer (:mod:`unimp_torch.layers`) and an op (:mod:`unimp_torch.op_overrides`).
Float64 tensors and non-floating ones are never cast.

>>> import torch
>>> x = torch.ones(2, dtype=torch.bfloat16)
>>> cast_inputs("float32", (x, [x]), {}, "cpu")[0][1][0].dtype
torch.float32
>>> with autocast_to("cpu", torch.float32):  # which torch.autocast refuses on CPU
...     torch.is_autocast_enabled("cpu")
True
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from unimp.spi import Plan, PlanRequest, dtypes

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
NAMES = {v: dtypes.dtype_name(v) for v in DTYPES.values()}
# ``Tensor.to(dtype)`` parses five overloads per call; the one-dtype methods do not
_CASTS = {torch.float32: torch.Tensor.float, torch.bfloat16: torch.Tensor.bfloat16, torch.float16: torch.Tensor.half}
_F64 = torch.float64
_SEQUENCES = (list, tuple)


def output_cast(plan: Plan | PlanRequest) -> torch.dtype | None:
    """The torch dtype the model's outputs are cast to under ``plan`` (or a request); None for ``output_dtype =
    "unchanged"`` (as ``torch.autocast`` leaves them)."""
    return DTYPES[plan.output_cast] if plan.output_cast else None


def floating(x: Any, device: str | None = None) -> bool:
    """A tensor a policy casts: floating, not float64 (on ``device`` when given)."""
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != _F64
            and (device is None or x.device.type == device))


def cast(x: Any, dtype: torch.dtype, device: str | None = None) -> Any:
    """``x`` (or each tensor of a list/tuple) cast to ``dtype`` when :func:`floating`; ``x`` itself when
    nothing changes. Called on every argument of every moved op: the cheap checks first."""
    if isinstance(x, torch.Tensor):
        have = x.dtype
        if have is dtype or have is _F64 or not have.is_floating_point or (
                device is not None and x.device.type != device):
            return x
        return _CASTS[dtype](x) if dtype in _CASTS else x.to(dtype)
    if isinstance(x, _SEQUENCES) and any(isinstance(t, torch.Tensor) for t in x):
        return type(x)([cast(t, dtype, device) for t in x])
    return x


def first_float(values: Iterable[Any]) -> torch.dtype | None:
    """The dtype of the first :func:`floating` tensor of ``values`` (None: none is)."""
    return next((v.dtype for v in values if floating(v)), None)


def widest(values: Iterable[Any], device: str | None = None) -> torch.dtype | None:
    """The widest dtype of the :func:`floating` tensors in ``values`` (and in its lists/tuples)."""
    out = None
    for a in values:
        for t in (a if isinstance(a, _SEQUENCES) else (a,)):
            if floating(t, device):
                out = t.dtype if out is None else torch.promote_types(out, t.dtype)
    return out


def cast_inputs(category: str, args: tuple, kwargs: dict, device: str) -> tuple[tuple, dict]:
    """The call's floating inputs as ``category`` says: ``float32``, ``lower`` (the autocast dtype),
    ``promote`` (the widest input); ``inputs`` leaves them as they are."""
    if category == "float32":
        dtype = torch.float32
    elif category == "lower":
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = widest((*args, *kwargs.values()), device) if category == "promote" else None
    if dtype is None:
        return args, kwargs
    args = tuple([cast(a, dtype, device) for a in args])  # out= is written to, never cast
    return args, ({k: v if k == "out" else cast(v, dtype, device) for k, v in kwargs.items()} if kwargs else kwargs)


def cast_output(out: Any, dtype: torch.dtype | None) -> Any:
    """Floating tensors in ``out`` (nested tuples/lists/dicts, HF ``ModelOutput``) cast to ``dtype``;
    a container is rebuilt only when something in it changed (``out`` itself otherwise). ``None``: ``out``."""
    if dtype is None:
        return out
    if isinstance(out, torch.Tensor):
        return out.to(dtype) if out.dtype != dtype and out.is_floating_point() else out
    if isinstance(out, list | tuple):
        items = [cast_output(o, dtype) for o in out]
        if all(a is b for a, b in zip(items, out)):
            return out
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, dict):
        changed = {k: c for k, v in out.items() if (c := cast_output(v, dtype)) is not v}
        if not changed:
            return out
        if dataclasses.is_dataclass(out):  # HF ModelOutput (made by this forward): its fields set in place
            for k, v in changed.items():
                out[k] = v
            return out
        return type(out)({**out, **changed})
    return out


@contextlib.contextmanager
def params_as(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Run ``module`` with its floating params cast to ``dtype`` (differentiably; restored after)."""
    swapped = [(m, n, p) for m in module.modules() for n, p in m._parameters.items()
               if floating(p) and p.dtype != dtype]
    done: dict[int, torch.Tensor] = {}  # a tied parameter is cast once (one gradient, summed in float32)
    for m, n, p in swapped:
        m._parameters[n] = done[id(p)] if id(p) in done else done.setdefault(id(p), p.to(dtype))
    try:
        yield
    finally:
        for m, n, p in swapped:
            m._parameters[n] = p


class _Float32Autocast:
    """``torch.autocast(device, dtype=torch.float32)``, which torch's Python wrapper refuses on CPU; its C++
    kernels run it (lower ops cast their inputs to float32) and ``torch.compile`` traces it."""

    __slots__ = ("device", "previous")

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> None:
        self.previous = torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device)
        torch.set_autocast_enabled(self.device, True)
        torch.set_autocast_dtype(self.device, torch.float32)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_enabled(self.device, self.previous[0])
        torch.set_autocast_dtype(self.device, self.previous[1])


def autocast_to(device: str, dtype: torch.dtype, cache: bool = False) -> Any:
    """``torch.autocast(device, dtype=dtype, cache_enabled=cache)``, float32 included (``cache`` False by default).

    torch's weight-cast cache is one map for the whole process, emptied whenever any thread leaves its outermost
    autocast: with it, a weight used twice in a forward gets one cast or two depending on other threads' timing (and
    its gradient summed in the low dtype or float32). Without it every use casts the weight, in every thread alike.
    """
    return _Float32Autocast(device) if dtype == torch.float32 else torch.autocast(device, dtype=dtype,
                                                                                  cache_enabled=cache)
