"""Op-level control: a ``TorchFunctionMode`` that runs the ops a policy moves the policy's way.

torch's autocast decides per aten op in C++, with fixed lists per device. For every torch
function whose canonical op the policy treats differently from torch (``op_moves`` of the Plan:
function name -> category), unimp's forward runs the model under :class:`PolicyMode`: a moved
call gets its floating inputs cast (``float32``; ``lower`` = the autocast dtype; ``promote`` = the
widest input; ``inputs`` = as they are) and runs with autocast off for that call, exactly what
torch's own C++ Autocast kernels do. Every other call goes straight through, and autocast handles
it. This covers functional calls (``torch.matmul``, ``q @ k.T``, ``F.scaled_dot_product_attention``,
``F.conv2d``) in both directions, needs no process-wide registration (other models and copies are
unaffected), and ``torch.compile`` traces it into the graph (no graph break, zero cost compiled).

Calls inside autocast-disabled regions are left alone (as torch's kernels are).
``F.multi_head_attention_forward`` (written in Python, the policy does not move it as a whole)
runs with the mode re-entered, through a copy that skips its own ``__torch_function__`` check, so
its inner calls (``softmax``, ``bmm``) follow the policy as they would at the aten level; other
torch functions written in Python wrap one C op, which the mode sees as that op.

>>> import torch
>>> mode = PolicyMode({"softmax": "float32"}, "cpu")
>>> with torch.autocast("cpu", dtype=torch.bfloat16), mode:
...     torch.randn(2, 4, dtype=torch.bfloat16).softmax(-1).dtype
torch.float32
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _eligible(x: Any, device: str) -> bool:
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == device
            and x.dtype != torch.float64)


def _widest(args: tuple, kwargs: dict, device: str) -> torch.dtype | None:
    out = None
    for a in (*args, *kwargs.values()):
        for t in (a if isinstance(a, list | tuple) else (a,)):
            if _eligible(t, device):
                out = t.dtype if out is None else torch.promote_types(out, t.dtype)
    return out


def _cast(x: Any, dtype: torch.dtype, device: str) -> Any:
    if isinstance(x, list | tuple):
        return type(x)([_cast(t, dtype, device) for t in x])
    return x.to(dtype) if _eligible(x, device) and x.dtype != dtype else x


# torch functions written in Python whose inner calls include ops a policy decides on (the rest
# are thin wrappers of one C op, which the mode sees as that op)
REENTER = ("multi_head_attention_forward",)


def _unchecked_copies() -> dict[Any, Any]:
    """For each function of :data:`REENTER`, a copy that skips its own ``__torch_function__``
    check, so a mode re-entered around it sees its inner calls (``softmax``, ``bmm``, ``linear``)."""
    import torch.nn.functional

    no_check = {"has_torch_function": lambda *a: False, "has_torch_function_unary": lambda *a: False,
                "has_torch_function_variadic": lambda *a: False}
    scope = {**vars(torch.nn.functional), **no_check}
    out = {}
    for name in REENTER:
        f = getattr(torch.nn.functional, name)
        copy = types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__, f.__closure__)
        copy.__kwdefaults__ = f.__kwdefaults__
        out[f] = copy
    return out


UNCHECKED = _unchecked_copies()


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``; a Tensor method (``x.size()``, or one written in Python such as
    ``Tensor.unflatten``) is called as a method, which torch.compile traces as the op it is."""
    if args and isinstance(args[0], torch.Tensor) and (
            getattr(func, "__objclass__", None) is torch._C.TensorBase
            or getattr(func, "__module__", None) == "torch._tensor"):
        return getattr(args[0], func.__name__)(*args[1:], **kwargs)
    return func(*args, **kwargs)


class PolicyMode(TorchFunctionMode):
    """Run torch functions named in ``rules`` (name -> category) as the policy says, on ``device``.

    Picklable and copyable (a plain table), so a copied or pickled model keeps its policy.
    """

    def __init__(self, rules: Mapping[str, str], device: str) -> None:
        super().__init__()
        self.device = device
        # in-place variants (``add_``) follow their op
        self.rules = {**{f"{n}_": c for n, c in rules.items() if not n.startswith("__")}, **rules}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        category = self.rules.get(getattr(func, "__name__", ""))
        if category is None or not torch.is_autocast_enabled(self.device):
            inner = UNCHECKED.get(func) if category is None else None
            if inner is not None:
                with self:  # a Python-level torch function: its inner calls follow the policy too
                    return inner(*args, **kwargs)
            if torch.compiler.is_compiling():
                return _call(func, args, kwargs)
            return func(*args, **kwargs)  # eager fast path: most calls end here
        if category == "float32":
            dtype = torch.float32
        elif category == "lower":
            dtype = torch.get_autocast_dtype(self.device)
        else:
            dtype = _widest(args, kwargs, self.device) if category == "promote" else None
        if dtype is not None:
            args = tuple(_cast(a, dtype, self.device) for a in args)
            kwargs = {k: _cast(v, dtype, self.device) for k, v in kwargs.items()}
        with torch.autocast(self.device, enabled=False):
            return _call(func, args, kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "rules": self.rules}

    def __setstate__(self, state: dict[str, Any]) -> None:
        TorchFunctionMode.__init__(self)
        self.__dict__.update(state)
