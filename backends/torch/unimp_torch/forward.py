"""The model's forward under the compiled plan: autocast, unimp's op rules, layout, output dtype.

With no op moves this is ``with torch.autocast(device, dtype, cache_enabled=False): model(x)`` plus the policy's
output cast (none for ``output_dtype = "unchanged"``); with moves, the ops run by the mechanism
:class:`unimp_torch.op_overrides.OpRules` picks. The forward is a :class:`PolicyForward` object on the instance:
``copy.deepcopy``, ``pickle``/``torch.save(model)`` and ``torch.compile`` (no graph break) work. Gradient
checkpointing: while an eager forward with op moves runs, torch's checkpoint hands the function it will
recompute through :func:`_under_rules`, so the recompute runs under the same rules.

>>> import torch
>>> m = torch.nn.Linear(4, 4)
>>> undo = patch_forward(m, "cpu", torch.bfloat16, {}, torch.float32, channels_last=False)
>>> m(torch.randn(2, 4)).dtype
torch.float32
>>> undo()
>>> undo = patch_forward(m, "cpu", torch.bfloat16, {}, None, channels_last=False)  # "unchanged"
>>> m(torch.randn(2, 4)).dtype
torch.bfloat16
>>> undo()
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt
from torch import nn

from .casts import autocast_to, cast_output, params_as
from .layers import install_forward
from .op_overrides import OpRules
from .trace import input_spec


def _nhwc(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point():
        return x.contiguous(memory_format=torch.channels_last)
    return x


_local = threading.local()  # .forward: the PolicyForward whose rules are active in this thread
# Held only across the count and the patch below. A finalizer running a unimp forward there re-enters it (an RLock):
# the count goes first and the originals are never checkpoint's patched names, so nesting at any line is right.
_patch_lock = threading.RLock()
_patch_users = 0
_originals: dict[str, Any] = {}  # torch.utils.checkpoint's own (kept once read)


def _under_rules(function: Callable) -> Callable:
    """``function`` to be recomputed by torch's checkpoint, run under the rules of the unimp forward
    that checkpoints it (``function`` itself where none runs in this thread)."""
    forward = getattr(_local, "forward", None)
    if forward is None:
        return function

    def recompute(*args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "forward", None) is forward:  # still inside that forward: rules on already
            return function(*args, **kwargs)
        with forward.rules():
            return function(*args, **kwargs)

    return recompute


class _ReentrantCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (checkpoint uses only ``apply``)."""

    @staticmethod
    def apply(function: Callable, preserve: bool, *args: Any) -> Any:
        return _originals["CheckpointFunction"].apply(_under_rules(function), preserve, *args)


def _non_reentrant(function: Callable, *rest: Any, **kwargs: Any) -> Any:
    return _originals["_checkpoint_without_reentrant_generator"](_under_rules(function), *rest, **kwargs)


class _CheckpointUnderRules:
    """While held (by any thread's unimp forward): torch's checkpoint recomputes under unimp's rules."""

    __slots__ = ()

    def __enter__(self) -> None:
        global _patch_users
        with _patch_lock:
            _patch_users += 1
            if _patch_users == 1:
                if _ckpt.CheckpointFunction is not _ReentrantCheckpoint:
                    _originals["CheckpointFunction"] = _ckpt.CheckpointFunction
                if (own := _ckpt._checkpoint_without_reentrant_generator) is not _non_reentrant:
                    _originals["_checkpoint_without_reentrant_generator"] = own
                _ckpt.CheckpointFunction = _ReentrantCheckpoint
                _ckpt._checkpoint_without_reentrant_generator = _non_reentrant

    def __exit__(self, *exc: object) -> None:
        global _patch_users
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                _ckpt.CheckpointFunction = _originals["CheckpointFunction"]
                _ckpt._checkpoint_without_reentrant_generator = _originals["_checkpoint_without_reentrant_generator"]


_checkpoint_under_rules = _CheckpointUnderRules()  # stateless: one object serves every forward


class _Rules:
    """The eager op rules of ``forward`` (:meth:`OpRules.eager`), marked as this thread's."""

    __slots__ = ("forward", "inner", "previous")

    def __init__(self, forward: PolicyForward) -> None:
        assert forward.ops is not None, "eager rules: a PolicyForward with op moves"
        self.forward = forward
        self.inner = forward.ops.eager()

    def __enter__(self) -> None:
        self.previous = getattr(_local, "forward", None)
        _local.forward = self.forward
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            _local.forward = self.previous


class PolicyForward:
    """``model.forward`` under the policy. Holds the model (not a closure over it), so copies and
    pickles of the model bring their own; ``observer`` (the first-forward report) is not copied."""

    def __init__(self, module: nn.Module, inner: Callable | None, device: str, autocast: torch.dtype | None,
                 table: Mapping[str, str], output: torch.dtype | None, channels_last: bool,
                 params: torch.dtype | None = None) -> None:
        self.module = module
        self.inner = inner  # the instance forward that was there before, else None (the class's)
        self.device = device
        self.autocast = autocast
        self.ops = OpRules(table, device) if table and autocast is not None else None  # the op moves
        self.output = output  # None: outputs not cast (output_dtype = "unchanged")
        self.channels_last = channels_last
        # parameters stored below a float32 compute dtype are cast up to it, differentiably, for the forward
        self.params = params
        self.observer: Any = None  # observe.Observer until the first eager forward has run
        self.compiled_inputs: Any = None  # trace.input_spec of the last compiled call (report() after compile)

    def close(self) -> None:
        """Release the kernels now (the undo of :func:`patch_forward`)."""
        if self.ops is not None:
            self.ops.close()

    def rules(self) -> _Rules:
        """unimp's eager op rules of this forward (inside autocast), marked as this thread's."""
        return _Rules(self)

    @contextlib.contextmanager
    def region(self, cache: bool = False) -> Iterator[None]:
        """Code around the model (a loss on its outputs) under the policy as its forward runs: autocast and
        the eager op rules (Lightning's ``forward_context``), without a cast cache (``casts.autocast_to``)."""
        if self.autocast is None:
            yield
            return
        with autocast_to(self.device, self.autocast, cache):
            if self.ops is None:
                yield
                return
            with self.rules(), _checkpoint_under_rules:
                yield

    def _run(self, compiling: bool, args: tuple, kwargs: dict, inner: Callable | None = None) -> Any:
        # the class's forward through functools.partial, not __get__ (dynamo 2.11 breaks the graph there)
        if inner is None:
            inner = self.inner if self.inner is not None else functools.partial(type(self.module).forward,
                                                                                 self.module)
        if self.params is not None:
            with params_as(self.module, self.params):
                return self._under_autocast(compiling, inner, args, kwargs)
        return self._under_autocast(compiling, inner, args, kwargs)

    def _under_autocast(self, compiling: bool, inner: Callable, args: tuple, kwargs: dict) -> Any:
        if self.autocast is None:
            return inner(*args, **kwargs)
        with autocast_to(self.device, self.autocast):
            if self.ops is None:
                return inner(*args, **kwargs)
            if not compiling:
                with self.rules(), _checkpoint_under_rules:
                    return inner(*args, **kwargs)
            with self.ops.mode:
                return inner(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.channels_last:
            args = tuple(_nhwc(a) for a in args)
        compiling = torch.compiler.is_compiling()  # decided once per forward
        if compiling:  # traced: the graph's inputs' shapes/dtypes are left here for amp.report()
            self.compiled_inputs = input_spec(args, kwargs)
        if not compiling and self.observer is not None:
            observer, self.observer = self.observer, None  # the first eager forward, observed as it runs
            return observer.run(self.module, lambda: cast_output(self._run(False, args, kwargs), self.output))
        return cast_output(self._run(compiling, args, kwargs), self.output)

    def __getstate__(self) -> dict[str, Any]:  # a copy or an unpickled model holds its own kernels (OpRules)
        return {**self.__dict__, "observer": None, "compiled_inputs": None}


class PolicyMethod:
    """Another entry point of the model (``generate``, ``encode``, ...) under the policy's compute rules,
    as ``with torch.autocast(...)`` around the call; its result is returned as the method made it."""

    def __init__(self, forward: PolicyForward, name: str) -> None:
        self.forward = forward
        self.name = name
        self.__wrapped__ = getattr(type(forward.module), name)  # what introspection sees (Lightning's is_overridden)
        self.__doc__ = getattr(self.__wrapped__, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, forward = self.forward.module, self.forward
        method = functools.partial(getattr(type(module), self.name), module)
        compiling = torch.compiler.is_compiling()
        if not compiling and forward.observer is not None:  # the first call after apply: observed whole (all
            observer, forward.observer = forward.observer, None  # the forwards generate() makes, its encoder's)
            try:
                return observer.run(module, lambda: forward._run(False, args, kwargs, method), entry=self.name)
            finally:
                if not observer.ran:  # a method that runs no layer (Lightning's on_fit_start): the next call tells
                    observer.rows = observer.entry = None
                    forward.observer = observer
        return forward._run(compiling, args, kwargs, method)

    @property
    def __signature__(self) -> inspect.Signature:  # the bound method's (callers read it: HF generate does)
        return inspect.signature(getattr(type(self.forward.module), self.name).__get__(self.forward.module))

    def __reduce__(self) -> tuple[Any, ...]:  # copies and pickles: rebuilt over the copied forward
        return (PolicyMethod, (self.forward, self.name))

    def __repr__(self) -> str:
        return f"<{type(self.forward.module).__name__}.{self.name} under a unimp policy>"


_NOT_ENTRY = ("_", "save", "push_to_hub", "load", "from_")


def entry_points(model: nn.Module) -> list[str]:
    """The model's public methods besides ``forward`` that may compute: those its own classes define
    (not ``torch.nn.Module``'s or overrides of them), except backward passes and saving/loading."""
    torch_names = set(dir(nn.Module))
    names = []
    for name in dir(type(model)):
        if name.startswith(_NOT_ENTRY) or name in torch_names or name in model.__dict__ or "backward" in name:
            continue
        attr = inspect.getattr_static(type(model), name, None)
        if not inspect.isfunction(attr):  # properties, class/static methods, attributes
            continue
        if attr.__module__ is not None and attr.__module__.split(".")[0] == "torch":
            continue
        names.append(name)
    return names


def patch_forward(model: nn.Module, device: str, autocast: torch.dtype | None, table: Mapping[str, str],
                  output: torch.dtype | None, channels_last: bool,
                  params: torch.dtype | None = None) -> Callable[[], None]:
    """Put a :class:`PolicyForward` on the instance (and a :class:`SingleOpForward` on each of
    torch's single-op modules whose op the kernels move to float32); returns the undo. ``output``: the
    dtype floating outputs are cast to (None: not cast, as autocast leaves them). ``params``:
    the dtype that parameters stored lower are cast up to for the forward (a float32 compute dtype)."""
    forward = PolicyForward(model, model.__dict__.get("forward"), device, autocast, table, output, channels_last,
                            params)
    undos: list[Callable[[], None]] = []

    def undo_and_release() -> None:
        for undo in reversed(undos):
            undo()
        forward.close()

    try:
        undos.append(install_forward(model, forward))
        if autocast is not None or params is not None:  # every other entry point under the same rules
            for name in entry_points(model):
                undos.append(_install_method(model, PolicyMethod(forward, name)))
        for module, single in forward.ops.single_op_forwards(model) if forward.ops is not None else ():
            undos.append(install_forward(module, single))
    except BaseException:  # half-way: the forwards installed so far and the kernels' hold released
        undo_and_release()
        raise
    return undo_and_release


def _install_method(model: nn.Module, method: PolicyMethod) -> Callable[[], None]:
    model.__dict__[method.name] = method

    def undo() -> None:
        if model.__dict__.get(method.name) is method:
            del model.__dict__[method.name]

    return undo
