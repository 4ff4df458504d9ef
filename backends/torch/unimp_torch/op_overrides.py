"""Op-level control: unimp's own Autocast kernels for the aten ops a policy moves.

torch registers Autocast kernels in C++ for a fixed list of ops per device; every other op falls
through the Autocast key. For a moved op *without* a native kernel on that device (CPU softmax,
layer_norm, exp, sum, ...), unimp registers a small kernel on ``AutocastCPU``/``AutocastCUDA``
through ``torch.library``. It casts only while a unimp forward is running (a thread-local table
set by :mod:`unimp_torch.forward`); anywhere else it simply falls through, exactly as before.
Kernels are registered once per process and dropped when the last Amp using them is removed.

>>> import torch
>>> handle = acquire({"softmax": "float32"}, "cpu")
>>> with torch.autocast("cpu", dtype=torch.bfloat16), active({"softmax": "float32"}):
...     torch.randn(2, 4, dtype=torch.bfloat16).softmax(-1).dtype
torch.float32
>>> release(handle)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from .native import AUTOCAST_KEYS, overloads

_state = threading.local()
_lib: Any = None
_registered: set[tuple[str, str]] = set()  # (qualified overload, device)
_users: dict[int, tuple[tuple[str, str], ...]] = {}


@contextlib.contextmanager
def active(table: Mapping[str, str] | None) -> Iterator[None]:
    """Make ``table`` (aten name -> category) the rules of unimp's kernels in this thread."""
    previous = getattr(_state, "table", None)
    _state.table = table
    try:
        yield
    finally:
        _state.table = previous


def _target(args: tuple, kwargs: dict, category: str, device: str) -> Any:
    import torch

    if category == "float32":
        return torch.float32
    if category == "lower":
        return torch.get_autocast_dtype(device)
    found = [t.dtype for t in _tensors(args, kwargs, device)]  # promote: the widest
    return _widest(found) if found else None


def _widest(dtypes: list) -> Any:
    import torch

    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _eligible(x: Any, device: str) -> bool:
    import torch

    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device
            and x.dtype != torch.float64)


def _tensors(args: tuple, kwargs: dict, device: str) -> list:
    out = []
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, list | tuple) else (a,)
        out.extend(t for t in items if _eligible(t, device))
    return out


def _cast(x: Any, dtype: Any, device: str) -> Any:
    if isinstance(x, list | tuple):
        return type(x)(_cast(t, dtype, device) for t in x)
    return x.to(dtype) if _eligible(x, device) and x.dtype != dtype else x


def _kernel(op: Any, name: str, device: str) -> Any:
    import torch

    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, AUTOCAST_KEYS[device]))

    def kernel(*args: Any, **kwargs: Any) -> Any:
        table = getattr(_state, "table", None)
        category = table.get(name) if table else None
        if category is not None:
            dtype = _target(args, kwargs, category, device)
            if dtype is not None:
                args = tuple(_cast(a, dtype, device) for a in args)
                kwargs = {k: _cast(v, dtype, device) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return op(*args, **kwargs)

    return kernel


def acquire(names: Mapping[str, str] | tuple[str, ...], device: str) -> int:
    """Register kernels for aten ``names`` on ``device`` (once per process); returns a handle."""
    import torch

    global _lib
    if _lib is None:
        _lib = torch.library.Library("aten", "IMPL")
    mine = []
    for name in names:
        for q in overloads(name):
            if (q, device) not in _registered:
                packet = getattr(torch.ops.aten, name)
                op = getattr(packet, q.split(".")[1] if "." in q else "default")
                _lib.impl(q, _kernel(op, name, device), AUTOCAST_KEYS[device])
                _registered.add((q, device))
            mine.append((q, device))
    if not mine:
        return 0
    handle = max(_users, default=0) + 1
    _users[handle] = tuple(mine)
    return handle


def release(handle: int) -> None:
    """Drop a handle; the kernels go away with the last user (torch's own behaviour returns)."""
    global _lib
    _users.pop(handle, None)
    if not _users and _lib is not None:
        _lib._destroy()
        _lib = None
        _registered.clear()
