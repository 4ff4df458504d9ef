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

Calls inside autocast-disabled regions are left alone (as torch's kernels are), and so are the
inner calls of a torch function implemented in Python that the policy does not move (torch runs
a mode's handler with the mode off).

>>> import torch
>>> mode = PolicyMode({"softmax": "float32"}, "cpu")
>>> with torch.autocast("cpu", dtype=torch.bfloat16), mode:
...     torch.randn(2, 4, dtype=torch.bfloat16).softmax(-1).dtype
torch.float32
"""

from __future__ import annotations

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
            return func(*args, **kwargs)
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
            return func(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "rules": self.rules}

    def __setstate__(self, state: dict[str, Any]) -> None:
        TorchFunctionMode.__init__(self)
        self.__dict__.update(state)
