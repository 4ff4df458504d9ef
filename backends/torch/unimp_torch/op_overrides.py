"""Op-level control: the ops a policy moves (the Plan's ``op_moves``) run the policy's way.

A moved call gets its floating inputs cast (``float32``; ``lower`` = the autocast dtype; ``promote`` = the widest
input; ``inputs`` = as they are) and runs with autocast off, as torch's C++ Autocast kernels do (an in-place
variant writes back into its input). :class:`OpRules` picks the mechanism per Plan:

* **Autocast kernels** (eager, when no moved op has a C++ Autocast kernel on the device): a ``torch.library``
  kernel on ``AutocastCPU``/``AutocastCUDA`` per moved aten op, acting only while a unimp forward runs in this
  thread (:func:`active`), held by :func:`acquire` handles. torch modules that are one such op apply the rule at
  their boundary (:class:`SingleOpForward`).
* :class:`PolicyMode`, a ``TorchFunctionMode`` (always under ``torch.compile``, traced into the graph; in eager
  when a moved op has a C++ kernel): covers functional calls too; in eager (:class:`EagerPolicyMode`) every call
  pays ``__torch_function__`` plus one dict look-up.

Calls inside autocast-disabled regions are left alone. ``F.multi_head_attention_forward`` runs with the mode
re-entered, so its inner calls follow the policy as they would at the aten level.

>>> import torch
>>> rules = OpRules({"softmax": "float32"}, "cpu")  # holds unimp's kernel for aten softmax
>>> with torch.autocast("cpu", dtype=torch.bfloat16), rules.eager():
...     torch.randn(2, 4, dtype=torch.bfloat16).softmax(-1).dtype
torch.float32
>>> rules.close()
>>> mode = PolicyMode({"softmax": "float32"}, "cpu")
>>> with torch.autocast("cpu", dtype=torch.bfloat16), mode:
...     torch.randn(2, 4, dtype=torch.bfloat16).softmax(-1).dtype
torch.float32
"""

from __future__ import annotations

import collections
import itertools
import threading
import types
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .autocast import AUTOCAST_KEYS, kernel_table, overloads
from .casts import cast, cast_inputs

# torch functions written in Python whose inner calls include ops a policy decides on
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
        kwargs, name = kwargs or {}, getattr(func, "__name__", "")
        category = self.rules.get(name)
        if category is None or not torch.is_autocast_enabled(self.device):
            inner = UNCHECKED.get(func) if category is None else None
            if inner is not None:
                with self:  # a Python-level torch function: its inner calls follow the policy too
                    return inner(*args, **kwargs)
            if torch.compiler.is_compiling():
                return _call(func, args, kwargs)
            return func(*args, **kwargs)  # eager fast path: most calls end here
        cast_args, kwargs = cast_inputs(category, args, kwargs, self.device)
        with torch.autocast(self.device, enabled=False):
            out = _call(func, cast_args, kwargs)
        if name[-1] == "_" and name[:2] != "__" and out.dtype != args[0].dtype:  # in place, on a cast copy of self
            return args[0].copy_(out)
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "rules": self.rules}

    def __setstate__(self, state: dict[str, Any]) -> None:
        TorchFunctionMode.__init__(self)
        self.__dict__.update(state)


class EagerPolicyMode(PolicyMode):
    """:class:`PolicyMode` for eager forwards only (not traceable): whether the policy leaves
    a torch function alone is decided once per function object (one dict look-up per call)."""

    def __init__(self, rules: Mapping[str, str], device: str) -> None:
        super().__init__(rules, device)
        self.passes: dict[Any, bool] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        try:
            passes = self.passes[func]
        except KeyError:
            passes = self.passes[func] = (self.rules.get(getattr(func, "__name__", "")) is None
                                          and func not in UNCHECKED)
        except TypeError:  # an unhashable callable: decided per call
            passes = False
        if passes:
            return func(*args, **kwargs) if kwargs else func(*args)
        return super().__torch_function__(func, types, args, kwargs)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.passes = {}


class OpRules:
    """The op moves of one forward on ``device``: :attr:`mode` (a :class:`PolicyMode`) under
    ``torch.compile``; in eager :meth:`eager`: unimp's Autocast kernels (``kernels``) or an :class:`EagerPolicyMode`."""

    def __init__(self, table: Mapping[str, str], device: str) -> None:
        self.device = device
        self.mode = PolicyMode(table, device)  # traced
        self.kernels = kernel_table(dict(table), device)
        self.eager_mode = EagerPolicyMode(table, device) if self.kernels is None else None
        self._hold: weakref.finalize | None = None
        self._acquire()

    def _acquire(self) -> None:
        if self.kernels:
            self._hold = weakref.finalize(self, release, acquire(self.kernels, self.device))

    def close(self) -> None:
        """Release the kernels now."""
        if self._hold is not None:
            self._hold()

    def eager(self) -> Any:
        """The eager rules as a context manager: the kernels' table made active, or the eager mode."""
        return active(self.kernels) if self.kernels is not None else self.eager_mode

    def single_op_forwards(self, model: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, SingleOpForward]]:
        """A :class:`SingleOpForward` for each of torch's single-op modules in ``model`` (not ``model``
        itself) whose op the kernels move to float32."""
        kernels = self.kernels or {}
        for module in model.modules() if kernels else ():
            op = single_op(module) if module is not model else None
            if op is not None and kernels.get(op) == "float32":
                yield module, SingleOpForward(module, op, self.device)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_hold": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._acquire()


_state = threading.local()  # .table: aten name -> category while a unimp forward runs in this thread
# Kernels are held by handles (acquire() registers what is missing; the last handle dropped destroys the library).
# Finalizers drop handles in any thread, maybe one inside acquire() holding _lock: release() never waits for it, it
# queues the handle, and whoever holds the lock drops the queue after letting it go (_drop_released).
_lock = threading.Lock()
_lib: Any = None
_registered: set[tuple[str, str]] = set()  # (qualified overload, device)
_users: dict[int, tuple[tuple[str, str], ...]] = {}
_released: collections.deque[int] = collections.deque()  # handles released, not dropped yet
_handles = itertools.count(1)


class active:
    """Make ``table`` (aten name -> category) the rules of unimp's kernels in this thread (a plain
    class, not a generator: entered once per forward)."""

    __slots__ = ("previous", "table")

    def __init__(self, table: Mapping[str, str] | None) -> None:
        self.table = table

    def __enter__(self) -> None:
        self.previous = getattr(_state, "table", None)
        _state.table = self.table

    def __exit__(self, *exc: object) -> None:
        _state.table = self.previous


def _kernel(op: Any, name: str, device: str) -> Any:
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, AUTOCAST_KEYS[device]))
    call, exclude = op._op, torch._C._ExcludeDispatchKeyGuard  # the C++ overload: no Python frame between

    def kernel(*args: Any, **kwargs: Any) -> Any:
        table = getattr(_state, "table", None)
        if table:
            category = table.get(name)
            if category is not None:
                args, kwargs = cast_inputs(category, args, kwargs, device)
        with exclude(keys):  # autocast off for this call, as torch's kernels do
            return call(*args, **kwargs)

    return kernel


# torch's own modules whose forward is one op on their input (and their parameters)
SINGLE_OP_MODULES = {torch.nn.LayerNorm: "layer_norm", torch.nn.GroupNorm: "group_norm",
                     torch.nn.RMSNorm: "rms_norm", torch.nn.Softmax: "softmax", torch.nn.LogSoftmax: "log_softmax"}


def single_op(module: torch.nn.Module) -> str | None:
    """The aten op ``module`` is (``nn.LayerNorm`` -> ``layer_norm``), when its forward is torch's own."""
    for cls, name in SINGLE_OP_MODULES.items():
        if type(module).forward is cls.forward and "forward" not in module.__dict__:
            return name
    return None


class SingleOpForward:
    """The forward of a torch module that is one op (:func:`single_op`) which unimp's kernels move
    to float32: while a unimp forward moves that op and the parameters are float32, it runs as the kernel would, at
    the module's boundary (no dispatcher round trip into Python); otherwise its forward runs as it is.
    """

    def __init__(self, module: torch.nn.Module, name: str, device: str) -> None:
        self.module = module
        self.name = name
        self.device = device
        self.keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, AUTOCAST_KEYS[device]))

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        module = self.module
        forward = type(module).forward
        if not torch.compiler.is_compiling():
            table = getattr(_state, "table", None)
            if table and table.get(self.name) == "float32" and torch.is_autocast_enabled(self.device):
                for p in module._parameters.values():
                    if p is not None and p.dtype != torch.float32:
                        break
                else:
                    with torch._C._ExcludeDispatchKeyGuard(self.keys):
                        return forward(module, cast(input, torch.float32, self.device))
        return forward(module, input)


def acquire(names: Mapping[str, str] | tuple[str, ...], device: str) -> int:
    """Register unimp's kernels for aten ``names`` on ``device`` (once per process); returns a handle."""
    global _lib
    try:
        with _lock:
            if _lib is None:
                _lib = torch.library.Library("aten", "IMPL")
            mine = []
            for name in names:
                for q in overloads(name):
                    if (q, device) not in _registered:
                        ov = q.split(".")[1] if "." in q else "default"
                        _lib.impl(q, _kernel(getattr(getattr(torch.ops.aten, name), ov), name, device),
                                  AUTOCAST_KEYS[device])
                        _registered.add((q, device))
                    mine.append((q, device))
            handle = next(_handles)
            _users[handle] = tuple(mine)
            return handle
    finally:
        _drop_released()


def release(handle: int) -> None:
    """Drop a handle; the kernels go away with the last one (torch's own behaviour returns).

    Never waits (a finalizer calls it, maybe inside :func:`acquire` in the same thread): when another
    caller holds the kernels' lock, the handle is dropped by that caller as it leaves."""
    _released.append(handle)
    _drop_released()


def _drop_released() -> None:
    """Drop the released handles if the lock is free now (else its holder does, on its way out)."""
    global _lib
    while _released and _lock.acquire(blocking=False):
        try:
            while _released:
                _users.pop(_released.popleft(), None)
            if not _users and _lib is not None:
                _lib._destroy()
                _lib = None
                _registered.clear()
        finally:
            _lock.release()
