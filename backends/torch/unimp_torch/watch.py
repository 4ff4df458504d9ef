"""``amp.watch()`` for torch: per-layer numerics on sampled steps, and where a skipped step's first non-finite value
appeared. Records, writers, hook scheduling and record assembly are the core's (:class:`unimp.watch.Watch`,
:class:`unimp.watch.eager.EagerWatch`); this module measures with torch's hooks and device ops, eager and traced.

Forward pre-hooks and hooks on the report's layers (:func:`unimp_torch.trace.is_layer`; the model itself aside) compute
on the device only (no host read, no graph break): per check one float32 sum (non-finite iff some value is), and on
sampled steps the amax and class counts in the layer's compute dtype against :func:`unimp.spi.dtypes.limits`, counted on
the bit patterns. The host reads them once at the end of a sampled or skipped step. A step is one update of the shared
loss scale (:mod:`unimp.loss_scale.iteration`): with several optimizers one record covers the whole iteration, skipped
when any of them skipped.

The backward: eager, a tensor hook on each layer's output (and, with ``localize``, on a view of each input); traced by
``torch.compile``, the same tensors pass through :class:`_Tap`, whose backward measures into the gradient of
:attr:`TorchWatch.probe` (no buffer a forward graph saved is written). Eager hooks are installed only for the steps that
use them; once the model runs compiled they stay installed and read :attr:`TorchWatch.checking` /
:attr:`TorchWatch.sampling` first (a model traced without them is traced again: ``torch.compiler.reset()``, said in a
:class:`UnimpWarning`).

>>> import torch, unimp
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
>>> amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
>>> watch = amp.watch(every=2)
>>> for _ in range(3):
...     amp.backward(amp.model(torch.randn(8, 4)).float().square().mean())
...     amp.optimizer.step(); amp.optimizer.zero_grad()
>>> [r["step"] for r in watch.records], watch.records[0]["layers"][0]["path"]
([0, 2], '0')
>>> _ = amp.remove()
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from unimp.spi import UnimpWarning, UnsupportedError, dtypes
from unimp.watch.eager import CODES, FP8_GRAD_OUT, GRAD_IN, GRAD_OUT, EagerWatch, Hook, Stats, fold

from .kinds import kind, type_names
from .optimizer import AmpOptimizer
from .trace import is_layer


class _Checking:
    """Whether a watch's hooks work on this step, read through :data:`_CHECKING` by one name for all hooks
    (a compiled graph that inlined them guards on it once: per-hook guards cost 1-2% per unwatched step)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


_CHECKING: dict[int, _Checking] = {}  # a running watch's serial -> its flag (no user object)
_serial = itertools.count(1)


class _Hook(Hook):
    """One of a layer's hooks (:class:`unimp.watch.eager.Hook`), read through :data:`_CHECKING` first;
    autocast is off on ``device`` while it measures."""

    def __init__(self, fn: Callable[..., Any], base: int, device: str, serial: int) -> None:
        super().__init__(fn, base)
        self.device, self.serial = device, serial

    def __call__(self, *args: Any) -> Any:
        flag = _CHECKING.get(self.serial)
        if flag is None or not flag.on:  # an unwatched step (a compiled graph guards on it: nothing traced)
            return None
        if self.device is not None and torch.is_autocast_enabled(self.device):
            with torch.autocast(self.device, enabled=False):
                return self.fn(self.base, *args)
        return self.fn(self.base, *args)


class TorchWatch(EagerWatch):
    """The device side of one :class:`unimp.watch.Watch` on one :class:`TorchAmp`: torch's hooks and device ops
    for :class:`unimp.watch.eager.EagerWatch`, and the traced path (device buffers, :class:`_Tap`)."""

    def __init__(self, amp: Any, session: Any) -> None:
        # the report's layers but the model itself (its output is its last layer's or its loss, checked
        # with the step's loss; its hooks would run outside a compiled forward, on every step)
        layers = [(p, m) for p, m in amp.module.named_modules() if p and is_layer(p, m)]
        super().__init__(amp, session, layers,
                         [amp.plan.decide(p, kind(m), type_names(m)).compute_dtype for p, m in layers])
        fp8 = amp.fp8.layers if amp.fp8 is not None else {}
        plan_fp8 = amp.plan.fp8
        self.fp8 = {i for i, p in enumerate(self.paths) if p in fp8}
        self.fp8_formats = ((dtypes.FP8_FORMATS[plan_fp8.forward_format], dtypes.FP8_FORMATS[plan_fp8.gradient_format])
                            if self.fp8 else None)
        targets = {*CODES[:4], *(self.fp8_formats or ())}
        self.bounds = {(dt, t): _bounds(dt, t) for dt in _INT_OF for t in targets}  # host work done here, once
        n = self.loss_slot + 1
        device = amp.scaler.device
        self.device = device.type
        # the traced hooks' buffers (eager hooks keep the base's host lists)
        self.flags = torch.zeros(n, dtype=torch.float32, device=device)  # sums: non-finite iff a value was
        self.seq = torch.full((n,), -1.0, dtype=torch.float32, device=device)  # traced hooks' first positions
        self.clock = torch.zeros((), dtype=torch.float32, device=device)
        self.amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.counts = torch.zeros(n, 7, dtype=torch.int64, device=device)  # the core's Watch.AT_LEAST
        self.codes = torch.full((n,), -1, dtype=torch.int64, device=device)
        # traced backwards measure into this leaf's gradient, one _ROW per slot (float64 holds the counts)
        self.probe = torch.zeros(n, _ROW, dtype=torch.float32 if device.type == "mps" else torch.float64,
                                 device=device, requires_grad=True)
        self.serial = next(_serial)
        _CHECKING[self.serial] = _Checking()

    def _arming(self) -> None:
        """Once the model runs compiled, the hooks stay installed (see the module's docstring)."""
        compiled = getattr(self.amp.module.__dict__.get("forward"), "compiled_inputs", None) is not None
        if compiled and not self.compiled:
            self.compiled = True
            if not self.handles:  # traced on a step without the hooks (or before the watch): trace again
                warnings.warn("amp.watch(): torch.compile traced this model without the watch's hooks, and it does "
                              "not see hooks added later; its compiled code is reset (torch.compiler.reset()) so "
                              "that the next step traces them", UnimpWarning, stacklevel=5)
                torch.compiler.reset()
        _CHECKING[self.serial].on = self.checking

    def _install(self, base: int, module: nn.Module) -> list[Any]:
        return [module.register_forward_pre_hook(_Hook(self._pre, base, self.device, self.serial), with_kwargs=True),
                module.register_forward_hook(_Hook(self._post, base, self.device, self.serial))]

    def _check(self, slot: int, tensors: Sequence[torch.Tensor], measured: torch.Tensor | None = None) -> None:
        """Traced: the sums go into the device buffer and the position is a device clock's (no Python side
        effect in a graph). Eager: the base's (:meth:`unimp.watch.eager.EagerWatch._check`)."""
        if not torch.compiler.is_compiling():
            return super()._check(slot, tensors, measured)
        for t in tensors:
            if t is not measured:
                self.flags[slot].add_(self._sum(t))
        self.seq[slot] = torch.where(self.seq[slot] < 0, self.clock, self.seq[slot])
        self.clock.add_(1)
        return None

    def _measure(self, slot: int, t: torch.Tensor, target: str, scaled: bool = False) -> None:
        """amax and class counts of ``t`` cast to ``target`` (``scaled``: after tensorwise scaling to its max,
        as an FP8 cast does). Eager: a tensor measured already this step is not measured again."""
        if not torch.compiler.is_compiling():
            return super()._measure(slot, t, target, scaled)
        amax, counts = _amax_and_counts(t, self._how(t, target, scaled))
        self.amax[slot] = torch.maximum(self.amax[slot], amax)
        self.counts[slot].add_(counts)
        self.codes[slot].fill_(CODES.index(target))

    def _count(self, t: torch.Tensor, target: str, scaled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return _amax_and_counts(t, self._how(t, target, scaled))

    def _how(self, t: torch.Tensor, target: str, scaled: bool = False) -> tuple:
        """What :func:`_amax_and_counts` needs to measure ``t`` in ``target`` (constants: traced as such): the
        bounds for ``t``'s own dtype and for float32, the format's max to scale to (FP8) or None, the code."""
        own = self.bounds[t.dtype, target] if t.dtype in _INT_OF else None
        return own, self.bounds[torch.float32, target], dtypes.limits(target).max if scaled else None, \
            CODES.index(target)

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[list[Any], Callable[[list[Any]], Any]]:
        if not kwargs:
            return list(args), lambda new: (tuple(new), kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        return leaves, lambda new: tree_unflatten(new, spec)

    def _tap_input(self, base: int, t: Any) -> Any:
        if not (isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()):
            return t
        if torch.compiler.is_compiling():
            return _Tap.apply(t, self.probe, (base + GRAD_IN, None, None))
        t = t.view_as(t)
        t.register_hook(functools.partial(self._grad_input, base))
        return t

    def _outputs(self, output: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
        if isinstance(output, torch.Tensor):
            return [output], lambda leaves: leaves[0]
        leaves, spec = tree_flatten(output)
        return leaves, lambda new: tree_unflatten(new, spec)

    def _floating(self, leaves: list[Any]) -> list[torch.Tensor]:
        return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]

    def _grad_enabled(self) -> bool:
        return torch.is_grad_enabled()

    def _tap_output(self, base: int, main: torch.Tensor) -> torch.Tensor | None:
        if not main.requires_grad:
            return None
        if not torch.compiler.is_compiling():
            main.register_hook(functools.partial(self._grad_output, base))
            return None
        measure = self._how(main, self._target(base, main)) if self.sampling else None
        fp8 = ((base + FP8_GRAD_OUT, self._how(main, self._fp8_format(1), scaled=True))
               if self.sampling and base // 6 in self.fp8 else None)
        return _Tap.apply(main, self.probe, (base + GRAD_OUT, measure, fp8))

    def _measure_fp8(self, slot: int, t: torch.Tensor) -> None:
        if slot // 6 in self.fp8:
            self._measure(slot, t, self._fp8_format(int(slot % 6 == FP8_GRAD_OUT)), scaled=True)

    def _fp8_format(self, side: int) -> Any:
        """The torch dtype of an FP8 layer's forward (0) or gradient (1) format (asked for FP8 layers only)."""
        assert self.fp8_formats is not None
        return self.fp8_formats[side]

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().sum(dtype=torch.float32)

    def _host(self, values: list[torch.Tensor]) -> list[Any]:
        return torch.stack([v.to(self.flags.device) for v in values]).tolist()

    def _width(self, t: torch.Tensor) -> int:
        return t.itemsize

    def _scale_now(self) -> torch.Tensor:
        return self.amp.scaler.scale.detach().clone()

    def _steps(self) -> int:
        return self.amp.scaler.steps

    def _skipped(self, flags: list[torch.Tensor]) -> list[bool]:
        """found_inf > 0, in one host read (free on CPU, one sync on CUDA with a fused optimizer)."""
        return [bool(flags[0] > 0)] if len(flags) == 1 else torch.stack(flags).reshape(-1).gt(0).tolist()

    def _param_grads(self) -> list[tuple[str, torch.Tensor]]:
        grads = [(opt.names.get(id(p), ""), p.grad) for opt in self.amp.optimizers for p in opt.master_params()
                 if p.grad is not None]
        return [(name, g._values() if g.is_sparse else getattr(g, "_local_tensor", g)) for name, g in grads]

    def _scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return (loss.float().sum() * self.scale_used.to(loss.device)).reshape(())

    def _clear_buffers(self) -> None:
        if self.checking:
            self.flags.zero_()
            self.seq.fill_(-1.0)
            self.clock.zero_()
            self.probe.grad = None
            if self.sampling:
                self.amax.zero_()
                self.counts.zero_()
                self.codes.fill_(-1)

    def _read_traced(self, positions: dict[int, float | None], flags: dict[int, float], stats: Stats) -> None:
        """The traced hooks' buffers and the traced backwards' probe rows (no position: the core mirrors the
        forward's)."""
        sums, seq = self.flags.tolist(), self.seq.tolist()
        amax, counts, codes = self.amax.tolist(), self.counts.tolist(), self.codes.tolist()
        for slot, code in enumerate(codes):
            if code >= 0:
                fold(stats, slot, code, amax[slot], counts[slot])
        for slot, s in enumerate(sums):
            if s:
                flags[slot] = flags.get(slot, 0.0) + s
        positions.update({slot: p for slot, p in enumerate(seq) if p >= 0})
        if self.probe.grad is not None:
            for slot, row in enumerate(self.probe.grad.tolist()):
                if row[_OCCURRED] <= 0:
                    continue
                flags[slot] = flags.get(slot, 0.0) + row[0]
                positions[slot] = None
                if row[_NUMEL] > 0:
                    stats[slot] = (round(row[_CODE] / row[_OCCURRED]), row[1], [round(c) for c in row[2:_NUMEL + 1]])

    def close(self) -> None:
        """Undo (the base's); a compiled graph that inlined the hooks runs its variant without them
        (``checking`` is False) and one guarded on the watch's flag traces again (without the hooks)."""
        _CHECKING.pop(self.serial, None)
        super().close()


# a probe row: the check sum, amax, _at_least's six counts, numel, how many taps wrote it, dtype code x that
_ROW, _NUMEL, _OCCURRED, _CODE = 11, 8, 9, 10


class _Tap(torch.autograd.Function):
    """A traced step's copy of a layer's output (or input, with ``localize``) whose backward checks, and on
    sampled steps measures (``measure``, ``fp8``: :meth:`TorchWatch._how`'s constants), the gradient into the
    probe's gradient row ``slot``. It writes no buffer: it returns a gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probe: torch.Tensor, spec: tuple) -> torch.Tensor:
        ctx.spec, ctx.probe = spec, (probe.shape, probe.dtype)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (slot, measure, fp8), (shape, dtype) = ctx.spec, ctx.probe
        rows = torch.zeros(shape, dtype=dtype, device=grad.device)
        rows[slot] = _row(grad, measure, dtype)
        if fp8 is not None:
            rows[fp8[0]] = _row(grad, fp8[1], dtype)
        return grad, rows, None


def _row(grad: torch.Tensor, measure: tuple | None, dtype: torch.dtype) -> torch.Tensor:
    """One probe row for ``grad`` (see :data:`_ROW`)."""
    total = grad.detach().sum(dtype=torch.float32).to(dtype)
    if measure is None:
        return torch.cat([total.reshape(1), grad.new_zeros(_NUMEL, dtype=dtype), grad.new_ones(1, dtype=dtype),
                          grad.new_zeros(1, dtype=dtype)])
    amax, counts = _amax_and_counts(grad, measure)
    code = measure[-1]
    return torch.cat([total.reshape(1), amax.to(dtype).reshape(1), counts.to(dtype),
                      grad.new_full((1,), 1.0, dtype=dtype), grad.new_full((1,), float(code), dtype=dtype)])


def _amax_and_counts(t: torch.Tensor, how: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest finite magnitude of ``t`` (float32) and :func:`_at_least`'s counts plus numel (int64, 7),
    as ``how`` (:meth:`TorchWatch._how`) says. Traced, a 16-bit tensor is counted as float32 (inductor's
    CPU code for 16-bit integers is not vectorised; a widening cast keeps every class)."""
    own, wide, scale_to, _ = how
    if (t.device.type in _COUNTED_FUSED and not torch.compiler.is_compiling()
            and not torch._C._len_torch_function_stack()):  # a function mode (unimp's trace) would be traced in
        fused = _fused()
        if fused is not None:  # one compiled kernel or two: the eager cost off the CPU is launches, not bytes
            try:  # flat, no view, no grad: one graph per dtype whatever the tensor's shape, pass and layout
                with torch.no_grad():
                    return fused(t.flatten().detach(), _against(wide, torch.int32, t.device), scale_to)
            except Exception as e:
                _no_fused(e)
    x = t.detach().abs()
    if scale_to is not None or own is None or (torch.compiler.is_compiling() and x.itemsize < 4):
        x, bounds = x.float(), wide
    else:
        bounds = own
    amax = x.nan_to_num(0.0, 0.0, 0.0).amax().float()
    if scale_to is not None:  # tensorwise to the format's max, as an FP8 cast scales
        x = x * torch.where(amax > 0, scale_to / amax, 1.0)
    if x.device.type in _COUNTED_PER_BOUND or torch.compiler.is_compiling():
        counts = torch.cat([_at_least(x, bounds), x.new_full((1,), x.numel(), dtype=torch.int64)])
    else:  # an accelerator: kernel launches, not bytes, are the eager cost
        counts = _at_least_at_once(x, bounds)
    return amax, counts


_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT_OF = {dt: _INT[dt.itemsize] for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


@functools.cache
def _bounds(dtype: torch.dtype, target: str) -> tuple[int, ...]:
    """Bit patterns of ``dtype``'s magnitudes (monotonic in the value) where a cast to ``target`` changes
    class: the smallest above zero, above ``underflow_at``, at or above ``normal_from``, at or above
    ``overflow_at``, +inf, and the first NaN (:class:`unimp.spi.dtypes.Limits`)."""
    lim = dtypes.limits(target)
    itype = _INT[dtype.itemsize]

    def pattern(value: float, up: bool) -> int:
        """The pattern of the smallest ``dtype`` value >= ``value`` (``up``), else of the largest <= it."""
        p = int(torch.tensor(value, dtype=torch.float64).to(dtype).view(itype))
        got = float(torch.tensor(p, dtype=itype).view(dtype))
        return p + 1 if up and got < value else p - 1 if not up and got > value else p

    inf = pattern(math.inf, True)
    return (1, pattern(lim.underflow_at, False) + 1, pattern(lim.normal_from, True),
            min(pattern(lim.overflow_at, True), inf), inf, inf + 1)


def _at_least(x: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """How many of ``x``'s magnitudes have a bit pattern >= each bound (``x`` non-negative), in vectorised
    integer passes (eager, a comparison producing booleans is several times slower on CPU)."""
    itype = _INT_OF[x.dtype]
    bits = x.view(itype) & torch.iinfo(itype).max  # the sign bit off (a NaN may keep it through abs)
    n = x.numel()
    distinct = sorted(set(bounds))  # in x's own dtype some coincide (nothing there underflows or overflows finite)
    if bits.dtype == torch.int64 or torch.compiler.is_compiling():  # traced: fused comparisons are fastest
        counts = [(bits >= b).sum() for b in distinct]
    else:  # (pattern - (b - 1)) clamped to [0, 1]: 1 where pattern >= b; counted in int32 where it holds n
        total = torch.int32 if n < 2**31 else torch.int64
        counts = [(bits - (b - 1)).clamp_(0, 1).sum(dtype=total).long() for b in distinct]
    return torch.stack([counts[distinct.index(b)] for b in bounds])


# device types whose eager counts run a pass per bound (CPU: a comparison to booleans is several times slower
# there than integer clamps); elsewhere one broadcast comparison (_at_least_at_once)
_COUNTED_PER_BOUND = frozenset({"cpu"})
_CHUNK = 1 << 25  # elements per comparison: its boolean [chunk, 7] stays at most 224 MiB


def _at_least_at_once(x: torch.Tensor, bounds: tuple[int, ...]) -> torch.Tensor:
    """:func:`_at_least`'s counts plus numel (int64, 7) in one broadcast comparison and one sum per chunk of
    ``x`` (the numel as the count of patterns >= 0): a few kernels per tensor where :func:`_at_least` launches
    four per bound (an eager sampled step on a GPU is dominated by launches, not by bytes)."""
    itype = _INT_OF[x.dtype]
    bits = (x.view(itype) & torch.iinfo(itype).max).reshape(-1, 1)
    against = _against(bounds, itype, x.device)
    if bits.shape[0] <= _CHUNK:
        return (bits >= against).sum(0)
    return torch.stack([(part >= against).sum(0) for part in bits.split(_CHUNK)]).sum(0)


# device types whose eager counts run compiled (_counted_in_float32 through torch.compile: amax and the seven
# counts in one fused reduction, where the eager ops launch about ten kernels per tensor)
_COUNTED_FUSED = frozenset({"cuda"})
_FUSED: list[Any] = []  # the compiled counting, made on first use; [None] once it proved unavailable


def _counted_in_float32(t: torch.Tensor, against: torch.Tensor, scale_to: float | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_amax_and_counts` as one traceable function: ``t`` widened to float32 (a widening cast keeps every
    class), scaled to ``scale_to`` by its amax if given, counted against ``against`` (float32 patterns of the
    bounds, and 0 for the numel)."""
    x = t.detach().float().abs()
    amax = x.nan_to_num(0.0, 0.0, 0.0).amax()
    if scale_to is not None:
        x = x * torch.where(amax > 0, scale_to / amax, 1.0)
    bits = x.view(torch.int32) & 0x7FFFFFFF
    return amax, torch.stack([(bits >= against[i]).sum() for i in range(against.numel())])


def _fused() -> Any:
    """The compiled :func:`_counted_in_float32` (dynamic shapes: one graph per dtype, not per shape), or None."""
    if not _FUSED:
        _FUSED.append(torch.compile(_counted_in_float32, dynamic=True, fullgraph=True))
    return _FUSED[0]


def _no_fused(error: BaseException) -> None:
    _FUSED[:] = [None]
    warnings.warn(f"amp.watch(): torch.compile could not build the watch's counting kernel here "
                  f"({type(error).__name__}: {str(error)[:200]}); sampled steps count with eager kernels "
                  f"(correct, slower)", UnimpWarning, stacklevel=2)


@functools.cache
def _against(bounds: tuple[int, ...], itype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``bounds`` and 0 on ``device``, made once (a copy to the device per tensor would wait on the stream)."""
    return torch.tensor((*bounds, 0), dtype=itype, device=device)


def start(amp: Any, session: Any) -> TorchWatch:
    """``amp.watch(...)``: bind ``session`` (the core's :class:`unimp.watch.Watch`) to the :class:`TorchAmp`
    ``amp``; returns the device side."""
    if amp.distributed is not None and amp.distributed.get("engine") == "fsdp2":
        raise UnsupportedError("amp.watch(): not available on an FSDP2-sharded model yet (its parameters and "
                               "gradients are shards); watch a data-parallel (amp.ddp()) or single-device run")
    return TorchWatch.begin(amp, session, counted=isinstance(amp.optimizer, AmpOptimizer))


def tensorboard(logdir: Any) -> Any:
    """torch's TensorBoard writer (``torch.utils.tensorboard.SummaryWriter``) at ``logdir``, for the core's
    :class:`~unimp.watch.writer.ScalarWriter`."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise UnsupportedError(f"amp.watch(tensorboard={str(logdir)!r:.60}): torch's TensorBoard writer needs the "
                               f"tensorboard package ({e}); pip install tensorboard, or use path= (JSON lines)"
                               ) from None
    return SummaryWriter(log_dir=str(logdir))

