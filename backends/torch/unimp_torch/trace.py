"""What really ran: per module path, the dtypes seen in one real forward.

A ``TorchFunctionMode`` records the output dtype of the first compute function (not casts, views, factories)
each module calls itself; forward hooks record output dtypes. A layer whose parent computes with its weights
(HF Mamba's mixer) gets those computations' dtypes. The first call after ``apply`` is observed as it runs
(:class:`Observer`); ``amp.report(x)`` runs :func:`observe` on an example input.

>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(4, 4))
>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     rows = observe(m, (torch.randn(2, 4),), {})
>>> rows["0"]["compute_dtype"]
'bfloat16'
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from unimp.spi import dtypes

from .casts import NAMES
from .kinds import kind, report_kind, type_names
from .ops import NATIVE_OPS

# torch functions that move, view, describe or create data: not where a module computes
NOT_COMPUTE = frozenset({
    "to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach", "detach_",
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose",
    "permute", "t", "expand", "expand_as", "__getitem__", "__setitem__", "chunk", "split", "narrow", "select",
    "unbind", "__get__", "__set__", "size", "dim", "numel", "cpu", "cuda", "requires_grad_", "zeros_like",
    "ones_like", "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
    "tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "copy_",
    "repeat", "tile", "masked_fill", "masked_fill_", "fill_", "zero_", "item", "tolist", "is_floating_point",
    "__len__", "__iter__", "__hash__", "__eq__", "__bool__", "_has_compatible_shallow_copy_type"})
ATTENTION_OPS = frozenset(NATIVE_OPS["attention"])


def is_layer(path: str, module: nn.Module) -> bool:
    """A row of ``amp.report()`` (and a layer ``amp.watch()`` measures): the model itself, a module with a
    kind, or a leaf module."""
    return not path or bool(kind(module) or report_kind(module)) or not any(True for _ in module.children())


def _dtype(x: Any) -> str | None:
    if isinstance(x, torch.Tensor):
        return dtypes.dtype_name(x.dtype)
    if isinstance(x, list | tuple):
        for t in x:
            d = _dtype(t)
            if d:
                return d
    if isinstance(x, dict):
        return _dtype(list(x.values()))
    return None


class _Recorder(TorchFunctionMode):
    """Output dtype of the first compute function each module (top of ``stack``) calls itself.

    A function-level mode: transparent to autograd and to every dispatcher kernel (a dispatch
    mode would change how some backends' kernels record gradients in the observed forward).
    """

    def __init__(self, owners: dict[int, tuple[torch.Tensor, list[str]]] | None = None) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.compute: dict[str, str] = {}
        self.attention: dict[str, str] = {}  # path -> dtype of the attention op it calls itself
        # id(weight or a view of it) -> (the tensor, the paths of the modules holding it); a weak dict of views
        self.owners = owners if owners is not None else {}
        self.views: dict[int, tuple[weakref.ref, list[str]]] = {}
        self.by_weight: dict[str, str] = {}  # path -> dtype of the first computation its parent made with its weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        path = self.stack[-1] if self.stack else None
        name = getattr(func, "__name__", "")
        if path is not None and name in ATTENTION_OPS and path not in self.attention:
            self.attention[path] = _dtype(out)
        if path is not None and path not in self.compute and name not in NOT_COMPUTE:
            d = _dtype(out)
            if d and d in NAMES.values():
                self.compute[path] = d
        if path is not None and self.owners:
            self._weights(path, name, args, kwargs, out)
        return out

    def _owners(self, t: Any) -> list[str]:
        if not isinstance(t, torch.Tensor):
            return []
        held = self.owners.get(id(t))
        if held is not None and held[0] is t:
            return held[1]
        view = self.views.get(id(t))
        return view[1] if view is not None and view[0]() is t else []

    def _weights(self, path: str, name: str, args: tuple, kwargs: dict | None, out: Any) -> None:
        """A computation of ``path`` with the weights of a module below it (not called itself): its dtypes
        are that module's; a view or cast of such a weight is followed to where it is used."""
        tensors = [*args, *(kwargs or {}).values()]
        below = [p for t in tensors for p in self._owners(t) if p.startswith(f"{path}.") or (not path and p)]
        if not below:
            return
        if name in NOT_COMPUTE:
            if isinstance(out, torch.Tensor):
                self.views[id(out)] = (weakref.ref(out), below)
            return
        d = _dtype(out)
        if d and d in NAMES.values():
            for p in below:
                self.by_weight.setdefault(p, d)


class Observer:
    """Records what one forward really ran, while it runs (the model runs once: no extra pass).

    ``run(model, fn)`` calls ``fn()`` (the model's forward) with hooks on every submodule and the
    recorder on; ``rows`` holds the result afterwards. Hooks are removed however ``fn`` ends.
    """

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] | None = None
        self.entry: str | None = None  # the entry point observed (None: forward)

    @property
    def ran(self) -> bool:
        """Whether the observed call ran a layer (a row below the root has a dtype)."""
        return any(path and (row["compute_dtype"] or row["output_dtype"]) for path, row in (self.rows or {}).items())

    def run(self, model: nn.Module, fn: Callable[[], Any], entry: str | None = None) -> Any:
        """``fn()`` observed. ``entry``: the name of the entry point ``fn`` calls (``"generate"``) instead of
        the forward: the model's own forward calls inside it are hooked too (its row's output dtype)."""
        owners: dict[int, tuple[torch.Tensor, list[str]]] = {}
        rows: dict[str, dict[str, Any]] = {}
        handles = []
        for path, m in model.named_modules():
            params = [p for p in m.parameters(recurse=False) if p.is_floating_point()]
            rows[path] = {"kind": kind(m) or report_kind(m), "param_dtype": _dtype(params[0]) if params else None,
                          "compute_dtype": None, "output_dtype": None, "types": type_names(m)}
            for p in params:
                owners.setdefault(id(p), (p, []))[1].append(path)
            if not path and entry is None:
                continue  # the root: recorded around fn (its own hooks are decided before it runs)

            def pre(_m: nn.Module, _a: Any, path: str = path) -> None:
                rec.stack.append(path)

            def post(_m: nn.Module, _a: Any, out: Any, path: str = path) -> None:
                rec.stack.pop()
                rows[path]["output_dtype"] = _dtype(out)

            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        rec = _Recorder(owners)
        rec.stack.append("")
        try:
            with rec:
                out = fn()
        finally:
            for h in handles:
                h.remove()
        if entry is None:
            rows[""]["output_dtype"] = _dtype(out)
        for path, row in rows.items():
            row["compute_dtype"] = rec.compute.get(path)
            if path and row["output_dtype"] is None and path in rec.by_weight:  # never called: what its weights made
                row["compute_dtype"] = row["output_dtype"] = rec.by_weight[path]
            if row["kind"] == "attention" and path in rec.attention:  # a block: its attention op's dtype
                row["compute_dtype"] = rec.attention[path]
            if row["kind"] == "batch_norm" and row["param_dtype"] == "float32" and row["compute_dtype"]:
                row["compute_dtype"] = "float32"  # torch's batch_norm computes in its fp32 params' dtype
        self.rows, self.entry = rows, entry
        return out


def observe(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, dict[str, Any]]:
    """Run ``model(*args, **kwargs)`` once more, without grad and leaving no trace (buffers such as
    BatchNorm statistics and the RNG are restored); per module path: kind and observed dtypes."""
    obs = Observer()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({b.device.index or 0 for b, _ in buffers if b.device.type == "cuda"})
    try:
        # eager even where the model was compiled in place (module.compile()): hooks and recorder see only what runs
        with torch.no_grad(), torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
            obs.run(model, lambda: model(*args, **kwargs))
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    assert obs.rows is not None
    return obs.rows


def input_spec(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor replaced by its shape, dtype and device (no arrays kept);
    traced by torch.compile without a graph break, so a compiled forward can leave it behind."""
    return tree_map(_spec, (args, kwargs))


def example_inputs(spec: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """Inputs of :func:`input_spec`'s shapes and dtypes (zeros), for a report-only forward."""
    return tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype, device=x.device) if isinstance(x, _Spec) else x,
                    spec)


class _Spec:
    """A tensor's shape, dtype and device (a pytree leaf)."""

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device


def _spec(x: Any) -> Any:
    return _Spec(x.shape, x.dtype, x.device) if isinstance(x, torch.Tensor) else x
