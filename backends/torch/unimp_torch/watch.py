"""``amp.watch()`` for torch: per-layer numerics on sampled steps, and where a skipped step's first
non-finite value appeared. The records, their order and the writers are the core's (:class:`unimp.watch.Watch`,
handed to :meth:`TorchAmp._start_watch`); this module measures.

Hooks on the report's layers (:func:`unimp_torch.trace.is_layer`; the model itself aside, whose output is
its last layer's or its loss, checked as the step's loss): a forward
pre-hook (the layer's input) and a forward hook (its output). Everything they compute stays on the
device (no host read, no Python side effect that ``torch.compile`` would break the graph for): per
check, one float32 sum (non-finite iff some value is), and on sampled steps the amax and the class
counts in the layer's compute dtype (the Plan's; a tensor already narrower: its own) against
:func:`unimp.spi.dtypes.limits`, counted on the bit patterns. The
host reads them once at the end of a step that is sampled or skipped (the skip flag is read on the host
at each step's end: free on CPU, one sync on CUDA with a fused optimizer, as a non-fused one always does).

A step is a training iteration: the update of the loss scale the Amp's optimizers share
(:mod:`unimp.loss_scale.iteration`), which a watch listens to. With several optimizers (``amp.optimizers``,
or another Amp's joined by ``share_scale_with=``: a GAN's ``netD`` and ``netG``) one record covers the
forwards and backwards of the whole iteration, whichever optimizer steps first, and a step is skipped
when some optimizer sharing the scale skipped (the scale backed off, as ``torch.amp.GradScaler.update()``
after ``found_inf`` in any of them). A watch on each of two Amps sharing one scale sees its own model's
layers; a record of an iteration this Amp's own optimizers stepped says which other one skipped.

The backward: in eager, a tensor hook on each layer's output (the gradient arriving there) and, with
``localize``, on a view of each input the layer takes (the gradient its backward produced for it).
Traced by ``torch.compile``, the same tensors pass through :class:`_Tap` (a copy whose backward
measures the gradient into the gradient of :attr:`TorchWatch.probe`, a leaf the backward accumulates
into): a compiled backward then writes no buffer a forward graph saved, whatever graph breaks the
model has, and its positions mirror the forward's (a gradient arrives at a layer's output in the
reverse order of the layers' returns, leaves its input in the reverse order of their calls).

Eager, the hooks are installed only for the steps that use them (sampled steps, every step with
``localize``): an unwatched step runs no hook at all. Once the model runs compiled they stay installed
(``torch.compile`` does not guard on module hooks: a graph traced without them would never run them)
and read :attr:`TorchWatch.checking` / :attr:`TorchWatch.sampling` first, which every graph that inlined
them guards on: an unwatched step runs the graph traced with nothing of the watch in it. A model that
``torch.compile`` traced before the watch started (or on a step without the hooks) is traced again:
``torch.compiler.reset()``, said in a :class:`UnimpWarning`.

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
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from unimp.spi import UnimpWarning, UnsupportedError, dtypes

from .layers import kind, type_names
from .optimizer import AmpOptimizer
from .trace import is_layer

# a layer's checked tensors: slot = 6 * layer + place; the loss has the last slot
IN, OUT, GRAD_OUT, GRAD_IN, FP8_IN, FP8_GRAD_OUT = range(6)
PLACES = ("input", "output", "grad_output", "grad_input", "fp8_input", "fp8_grad_output")
LOSS_PATH = "<loss>"
CODES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")  # dtype codes in the buffer


def _floating(leaves: list[Any]) -> list[torch.Tensor]:
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


class _NotCopied:
    """What the model, the optimizer or the Amp hold while watched: their copies and pickles get
    ``copied_as`` instead (a copied model is not watched: its hooks must not write into this watch)."""

    copied_as: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.copied_as

    def __reduce__(self) -> tuple[Any, ...]:
        return (_none, ()) if self.copied_as is None else (_Inert, ())


def _none() -> None:
    return None


class _Inert:
    """A hook that does nothing (what a copy of a watched model holds)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Checking:
    """Whether a watch's hooks work on this step: the first thing every hook reads. Read through the module
    global :data:`_CHECKING` by one name for all its hooks, so a compiled graph that inlined them guards on it
    once (read through each hook's own attributes, its guards made an unwatched compiled step 1-2% slower)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


_CHECKING: dict[int, _Checking] = {}  # a running watch's serial -> its flag (no user object)
_serial = itertools.count(1)


class _Hook(_NotCopied):
    """One of a layer's hooks: calls ``fn`` (a method of :class:`TorchWatch`) with the layer's first slot.
    ``device``: a forward hook's device type; the policy's autocast (and unimp's own kernels for the ops it
    moves) is off while the hook measures (its sums and counts are the watch's, not the model's)."""

    copied_as = _Inert()

    def __init__(self, fn: Callable[..., Any], base: int, device: str, serial: int) -> None:
        self.fn, self.base, self.device, self.serial = fn, base, device, serial

    def __call__(self, *args: Any) -> Any:
        flag = _CHECKING.get(self.serial)
        if flag is None or not flag.on:  # an unwatched step (a compiled graph guards on it: nothing traced)
            return None
        if self.device is not None and torch.is_autocast_enabled(self.device):
            with torch.autocast(self.device, enabled=False):
                return self.fn(self.base, *args)
        return self.fn(self.base, *args)


class TorchWatch(_NotCopied):
    """The device side of one :class:`unimp.watch.Watch` on one :class:`TorchAmp`."""

    def __init__(self, amp: Any, session: Any) -> None:
        self.amp, self.session = amp, session
        self.localize = session.localize
        # the report's layers but the model itself (its output is its last layer's or its loss, checked
        # with the step's loss; its hooks would run outside a compiled forward, on every step)
        self.layers = [(p, m) for p, m in amp.module.named_modules() if p and is_layer(p, m)]
        self.paths = [p for p, _ in self.layers]
        fp8 = amp.fp8.layers if amp.fp8 is not None else {}
        plan_fp8 = amp.plan.fp8
        self.fp8 = {i for i, p in enumerate(self.paths) if p in fp8}
        self.fp8_formats = ((dtypes.FP8_FORMATS[plan_fp8.forward_format], dtypes.FP8_FORMATS[plan_fp8.gradient_format])
                            if self.fp8 else None)
        # each layer's compute dtype as the Plan decides it (None: it follows its inputs)
        self.compute = [amp.plan.decide(p, kind(m), type_names(m)).compute_dtype for p, m in self.layers]
        targets = {*CODES[:4], *(self.fp8_formats or ())}
        self.bounds = {(dt, t): _bounds(dt, t) for dt in _INT_OF for t in targets}  # host work done here, once
        n = 6 * len(self.layers) + 1
        self.loss_slot = n - 1
        device = amp.scaler.device
        self.device = device.type
        self.flags = torch.zeros(n, dtype=torch.float32, device=device)  # sums: non-finite iff a value was
        self.seq = torch.full((n,), -1.0, dtype=torch.float32, device=device)  # traced hooks' first positions
        self.clock = torch.zeros((), dtype=torch.float32, device=device)
        self.amax = torch.zeros(n, dtype=torch.float32, device=device)
        self.counts = torch.zeros(n, 7, dtype=torch.int64, device=device)  # the core's Watch.AT_LEAST
        self.codes = torch.full((n,), -1, dtype=torch.int64, device=device)
        # traced backwards measure into this leaf's gradient, one _ROW per slot (float64 holds the counts)
        self.probe = torch.zeros(n, _ROW, dtype=torch.float32 if device.type == "mps" else torch.float64,
                                 device=device, requires_grad=True)
        self.order: list[int] = []  # eager hooks' slots, first occurrence in the step, in execution order
        self.seen: set[int] = set()
        self.pending: list[tuple[int, torch.Tensor]] = []  # eager checks of the step: (slot, float32 sum)
        # eager measurements of the step: (slot, amax, counts), folded into the buffers when the host reads
        self.pending_measures: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.pending_codes: dict[int, int] = {}  # eager: slot -> dtype code (a host constant)
        self.checked: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self.measured: dict[int, tuple[weakref.ref, int, tuple[str, bool]]] = {}  # eager: id -> (tensor, slot, how)
        self.same: dict[int, int] = {}  # eager: slot -> the slot that measured the same tensor this step
        self.losses: list[torch.Tensor] = []
        self.scale_used: torch.Tensor | None = None
        self.backward_order: list[str] = [p for p in reversed(self.paths)]  # until a backward is seen
        self.sampling = self.checking = False  # read first by every hook (a compiled graph guards on them)
        self.compiled = False  # the model ran compiled: hooks stay installed
        self.serial = next(_serial)
        _CHECKING[self.serial] = _Checking()
        self.handles: list[Any] = []
        self.step = amp.scaler.steps  # the index of the next step

    # ------------------------------------------------------------------ install
    def arm(self) -> None:
        """Hooks for the next step: eager, installed when it is sampled (or always with ``localize``), else
        none; once the model runs compiled, installed for good (see the module's docstring). None once the
        watch closed (a full disk under its file closes it from inside the step's record)."""
        if self.session.closed:
            return
        compiled = getattr(self.amp.module.__dict__.get("forward"), "compiled_inputs", None) is not None
        if compiled and not self.compiled:
            self.compiled = True
            if not self.handles:  # traced on a step without the hooks (or before the watch): trace again
                warnings.warn("amp.watch(): torch.compile traced this model without the watch's hooks, and it does "
                              "not see hooks added later; its compiled code is reset (torch.compiler.reset()) so "
                              "that the next step traces them", UnimpWarning, stacklevel=4)
                torch.compiler.reset()
        self.sampling = self.session.sampled(self.step)
        self.checking = _CHECKING[self.serial].on = self.sampling or self.localize
        if (self.checking or self.compiled) and not self.handles:
            for i, (_, module) in enumerate(self.layers):
                self.handles += [
                    module.register_forward_pre_hook(_Hook(self._pre, 6 * i, self.device, self.serial),
                                                     with_kwargs=True),
                    module.register_forward_hook(_Hook(self._post, 6 * i, self.device, self.serial))]
        elif not (self.checking or self.compiled) and self.handles:
            self.disarm()

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ on the device, per hook
    def _check(self, slot: int, tensors: list[torch.Tensor], measured: torch.Tensor | None = None) -> None:
        """Check ``tensors`` for non-finite values (a float32 sum each: non-finite iff one of its values is;
        ``measured``: checked by its counts instead) and note the slot's position in the step.

        Traced: the sums go into the device buffer and the position is a device clock's (no Python side
        effect in a graph). Eager: the sums are kept until the host reads the step (none is read on a
        step neither sampled nor skipped), the position is the order the hooks ran in, and a tensor
        already checked this step (a layer's input that another layer returned) is not summed again."""
        if torch.compiler.is_compiling():
            for t in tensors:
                if t is not measured:
                    self.flags[slot].add_(t.detach().sum(dtype=torch.float32))
            self.seq[slot] = torch.where(self.seq[slot] < 0, self.clock, self.seq[slot])
            self.clock.add_(1)
            return
        for t in tensors:
            if self.checked.get(id(t)) is not t:
                self.checked[id(t)] = t
                if t is not measured:
                    self.pending.append((slot, t.detach().sum(dtype=torch.float32)))
        if slot not in self.seen:
            self.seen.add(slot)
            self.order.append(slot)

    def _measure(self, slot: int, t: torch.Tensor, target: str, scaled: bool = False) -> None:
        """amax and class counts of ``t`` cast to ``target`` (``scaled``: after tensorwise scaling to ``target``'s
        max, as an FP8 cast does; else ``t`` as it is, in its dtype or in a narrower ``target``). Eager: a tensor
        measured already this step (a layer returning its last child's output) is not measured again."""
        if not torch.compiler.is_compiling():
            seen = self.measured.get(id(t))
            if seen is not None and seen[0]() is t and seen[2] == (target, scaled):
                self.same[slot] = seen[1]
                return
            self.measured[id(t)] = (weakref.ref(t), slot, (target, scaled))
            amax, counts = _amax_and_counts(t, self._how(t, target, scaled))
            self.pending_measures.append((slot, amax, counts))  # folded in by _read: no kernel per slot here
            self.pending_codes[slot] = CODES.index(target)
            return
        amax, counts = _amax_and_counts(t, self._how(t, target, scaled))
        self.amax[slot] = torch.maximum(self.amax[slot], amax)
        self.counts[slot].add_(counts)
        self.codes[slot].fill_(CODES.index(target))

    def _how(self, t: torch.Tensor, target: str, scaled: bool = False) -> tuple:
        """What :func:`_amax_and_counts` needs to measure ``t`` in ``target`` (constants: traced as such): the
        bounds for ``t``'s own dtype and for float32, the format's max to scale to (FP8) or None, the code."""
        own = self.bounds[t.dtype, target] if t.dtype in _INT_OF else None
        return own, self.bounds[torch.float32, target], dtypes.limits(target).max if scaled else None, \
            CODES.index(target)

    def _target(self, base: int, t: torch.Tensor) -> str:
        """The dtype ``t`` is measured in: its layer's compute dtype where ``t`` is wider (a float32 output
        of a layer that computed in float16), else its own."""
        own, compute = dtypes.dtype_name(t.dtype), self.compute[base // 6]
        return compute if compute in ("float16", "bfloat16") and t.itemsize > 2 else own

    def _pre(self, base: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self.checking or not torch.is_grad_enabled():  # a no-grad forward (evaluation, amp.report(x))
            return None
        leaves, spec = (list(args), None) if not kwargs else tree_flatten((args, kwargs))
        floating = _floating(leaves)
        if not floating:
            return None
        self._check(base + IN, floating)
        if self.sampling and base // 6 in self.fp8:
            self._measure(base + FP8_IN, floating[0], self._fp8_format(0), scaled=True)
        if not self.localize:
            return None
        # each input the layer takes, as a tensor only it uses: the gradient its backward produces for it
        compiling, changed = torch.compiler.is_compiling(), False
        hook = functools.partial(self._grad_input, base)
        for i, t in enumerate(leaves):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point():
                if compiling:
                    leaves[i] = _Tap.apply(t, self.probe, (base + GRAD_IN, None, None))
                else:
                    leaves[i] = t.view_as(t)
                    leaves[i].register_hook(hook)
                changed = True
        if not changed:
            return None
        return (tuple(leaves), kwargs) if spec is None else tree_unflatten(leaves, spec)

    def _post(self, base: int, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self.checking or not torch.is_grad_enabled():
            return None
        leaves, spec = ([output], None) if isinstance(output, torch.Tensor) else tree_flatten(output)
        floating = _floating(leaves)
        if not floating:
            return None
        main = floating[0]
        if self.sampling:
            self._measure(base + OUT, main, self._target(base, main))
        self._check(base + OUT, floating, measured=main if self.sampling else None)
        if not main.requires_grad:
            return None
        if not torch.compiler.is_compiling():
            main.register_hook(functools.partial(self._grad_output, base))
            return None
        measure = self._how(main, self._target(base, main)) if self.sampling else None
        fp8 = ((base + FP8_GRAD_OUT, self._how(main, self._fp8_format(1), scaled=True))
               if self.sampling and base // 6 in self.fp8 else None)
        leaves[leaves.index(main)] = _Tap.apply(main, self.probe, (base + GRAD_OUT, measure, fp8))
        return leaves[0] if spec is None else tree_unflatten(leaves, spec)

    def _fp8_format(self, side: int) -> Any:
        """The torch dtype of an FP8 layer's forward (0) or gradient (1) format (asked for FP8 layers only)."""
        assert self.fp8_formats is not None
        return self.fp8_formats[side]

    def _grad_output(self, base: int, grad: torch.Tensor) -> None:
        if self.sampling:
            self._measure(base + GRAD_OUT, grad, self._target(base, grad))
            if base // 6 in self.fp8:
                self._measure(base + FP8_GRAD_OUT, grad, self._fp8_format(1), scaled=True)
        self._check(base + GRAD_OUT, [grad], measured=grad if self.sampling else None)

    def _grad_input(self, base: int, grad: torch.Tensor) -> None:
        self._check(base + GRAD_IN, [grad])

    # ------------------------------------------------------------------ per step, on the host
    def loss(self, loss: torch.Tensor) -> None:
        """``amp.backward(loss)`` / ``amp.scale_loss(loss)``: the loss and the scale it is scaled by."""
        self.losses.append(loss.detach())
        self.scale_used = self.amp.scaler.scale.detach().clone()

    def step_end(self, found: dict[AmpOptimizer, torch.Tensor | None]) -> None:
        """The iteration ended (the shared loss scale's update, from the flags in ``found``: each optimizer
        stepped since the last update -> its found_inf): record it if it was sampled or skipped, then arm the
        next."""
        try:
            flags = {m: f for m, f in found.items() if f is not None} if self.amp.scaler.spec.skip_nonfinite else {}
            values = list(flags.values())
            read = ([] if not values else [bool(values[0] > 0)] if len(values) == 1
                    else torch.stack(values).reshape(-1).gt(0).tolist())  # one host read
            bad = dict(zip(flags, read, strict=True))
            if self.sampling or any(bad.values()):
                self._record(any(bad.values()), self._skipped_elsewhere(bad))
        finally:
            self._reset()
            self.step = self.amp.scaler.steps
            self.arm()

    def _reset(self) -> None:
        if self.checking:
            self.flags.zero_()
            self.seq.fill_(-1.0)
            self.clock.zero_()
            self.probe.grad = None
            if self.sampling:
                self.amax.zero_()
                self.counts.zero_()
                self.codes.fill_(-1)
        self.order.clear()
        self.seen.clear()
        self.pending.clear()
        self.pending_measures.clear()
        self.pending_codes.clear()
        self.checked.clear()
        self.measured.clear()
        self.same.clear()
        self.losses.clear()

    def _read(self) -> tuple[dict[int, float | None], list[float], list[float], list[list[int]], list[int]]:
        """The step as the host sees it: positions (slot -> place in its pass), the check sums, and the
        measured amax, counts and dtype codes per slot (eager buffers, traced backwards' probe rows)."""
        if self.pending:
            slots, sums = zip(*self.pending, strict=True)
            self.flags.index_add_(0, torch.tensor(slots, device=self.flags.device), torch.stack(sums))
        if self.pending_measures:
            slots, amaxes, counted = zip(*self.pending_measures, strict=True)
            index = torch.tensor(slots, device=self.amax.device)
            self.amax.scatter_reduce_(0, index, torch.stack(amaxes), "amax")  # magnitudes: >= the buffer's 0
            self.counts.index_add_(0, index, torch.stack(counted))
        flags, seq = self.flags.tolist(), self.seq.tolist()
        amax, counts, codes = self.amax.tolist(), self.counts.tolist(), self.codes.tolist()
        for slot, code in self.pending_codes.items():
            codes[slot] = code
        for slot, src in self.same.items():  # the same tensor measured once for two layers
            amax[slot], counts[slot], codes[slot] = amax[src], counts[src], codes[src]
        positions: dict[int, float | None] = {slot: float(i) for i, slot in enumerate(self.order)}
        positions.update({slot: p for slot, p in enumerate(seq) if p >= 0})
        if self.probe.grad is not None:  # traced backwards: no position (the core mirrors the forward's)
            for slot, row in enumerate(self.probe.grad.tolist()):
                if row[_OCCURRED] <= 0:
                    continue
                flags[slot] += row[0]
                positions[slot] = None
                if row[_NUMEL] > 0:
                    amax[slot], counts[slot] = row[1], [round(c) for c in row[2:_NUMEL + 1]]
                    codes[slot] = round(row[_CODE] / row[_OCCURRED])
        return positions, flags, amax, counts, codes

    def _skipped_elsewhere(self, bad: dict[AmpOptimizer, bool]) -> list[str]:
        """A note when only optimizers of other Amps sharing the scale skipped (this model's stepped)."""
        own = set(map(id, self.amp.optimizers))
        if not any(bad.values()) or any(b for m, b in bad.items() if id(m) in own):
            return []
        others = [f"{type(m.optimizer).__name__} of {next(iter(m.names.values()), '?')}"
                  for m, b in bad.items() if b and id(m) not in own]
        return [f"this model's optimizers stepped; the iteration is skipped because another optimizer sharing "
                f"the loss scale had non-finite gradients ({', '.join(others)}): watch that model's Amp to "
                f"locate them"]

    def _record(self, skipped: bool, notes: Sequence[str] = ()) -> None:
        scale = float(self.scale_used.item()) if self.scale_used is not None else None
        positions, flags, amax, counts, codes = self._read() if self.checking else ({}, [], [], [], [])
        events = [(self.paths[slot // 6], PLACES[slot % 6], pos,
                   _finite(flags[slot]) and not (codes[slot] >= 0 and counts[slot][4]))  # measured: counts say
                  for slot, pos in positions.items() if slot != self.loss_slot and slot % 6 < FP8_IN]
        if skipped:
            events += self._loss_and_params()
        arrivals = sorted((pos, self.paths[slot // 6]) for slot, pos in positions.items()
                          if slot % 6 == GRAD_OUT and slot != self.loss_slot and pos is not None)
        if arrivals:  # the gradient-arrival order this step saw (for later steps located by parameters only)
            self.backward_order = list(dict.fromkeys(p for _, p in arrivals))
        layers = self._stats(positions, amax, counts, codes) if self.sampling else []
        self.session.add(self.step, skipped=skipped, scale=scale, sampled=self.sampling, layers=layers,
                         events=events, backward_order=self.backward_order, notes=notes)

    def _loss_and_params(self) -> list[tuple[str, str, None, bool]]:
        """A skipped step: the scaled loss and every parameter gradient it left (of every optimizer of the Amp),
        checked in one host read."""
        grads = [(opt.names.get(id(p), ""), p.grad) for opt in self.amp.optimizers for p in opt.master_params()
                 if p.grad is not None]
        tensors = [g._values() if g.is_sparse else getattr(g, "_local_tensor", g) for _, g in grads]
        scale = self.scale_used if self.scale_used is not None else torch.ones(())
        sums = [(loss.float().sum() * scale.to(loss.device)).reshape(()) for loss in self.losses]
        sums += [t.detach().sum(dtype=torch.float32) for t in tensors]
        if not sums:
            return []
        finite = torch.isfinite(torch.stack([s.to(self.flags.device) for s in sums])).tolist()
        out: list[tuple[str, str, None, bool]] = []
        if self.losses:
            out.append((LOSS_PATH, "loss", None, all(finite[:len(self.losses)])))
        for (name, _), ok in zip(grads, finite[len(self.losses):], strict=True):
            out.append((name.rpartition(".")[0], "grad_param", None, ok))
        return out

    def _stats(self, positions: dict[int, float | None], amax: list[float], counts: list[list[int]],
               codes: list[int]) -> list[tuple[str, str, str, float, list[int]]]:
        """The measured tensors, in execution order: the forward's as the layers returned, then the
        backward's as the gradients arrived (traced: in the reverse order of the returns); an FP8 tensor
        next to its layer's output or gradient."""
        def order(slot: int) -> tuple[int, float, int]:
            backward = slot % 6 in (GRAD_OUT, FP8_GRAD_OUT)
            anchor = slot - slot % 6 + (GRAD_OUT if backward else OUT)
            position = positions.get(anchor)
            if position is None and backward:
                position = -(positions.get(anchor - GRAD_OUT + OUT) or 0.0)
            return int(backward), position or 0.0, slot

        return [(self.paths[slot // 6], PLACES[slot % 6], CODES[codes[slot]], amax[slot], counts[slot])
                for slot in sorted((s for s, code in enumerate(codes) if code >= 0), key=order)]

    def close(self) -> None:
        """Undo: hooks removed, the Amp's taps cleared (``watch.close()``, ``amp.unwatch()``, ``amp.remove()``).
        A compiled graph that inlined the hooks runs its variant without them (``checking`` is False)."""
        self.checking = self.sampling = False
        _CHECKING.pop(self.serial, None)  # a compiled graph guarded on it traces again (without the hooks)
        self.disarm()
        if self.amp._watching is self:
            self.amp._watching = None
        self.amp.iteration.unwatch(self)


# a probe row: the check sum, amax, _at_least's six counts, numel, how many taps wrote it, dtype code x that
_ROW, _NUMEL, _OCCURRED, _CODE = 11, 8, 9, 10


class _Tap(torch.autograd.Function):
    """A traced step's view of a layer's output (or, with ``localize``, input): a copy (later in-place ops on
    it stay legal) whose backward checks, and on sampled steps measures, the gradient into the probe's
    gradient row ``slot`` (``measure``: :meth:`TorchWatch._how`'s constants; ``fp8``: a second row and its
    constants for an FP8 layer's gradient format). The backward writes no buffer: it returns a gradient."""

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


def _finite(x: float) -> bool:
    return x - x == 0.0  # False for inf and NaN


def start(amp: Any, session: Any) -> TorchWatch:
    """``amp.watch(...)``: bind ``session`` (the core's :class:`unimp.watch.Watch`) to the :class:`TorchAmp`
    ``amp``; returns the device side."""
    if not isinstance(amp.optimizer, AmpOptimizer):
        raise UnsupportedError("amp.watch(): a watch counts training steps through amp.optimizer.step(); apply the "
                               "policy with the optimizer: amp = unimp.apply(policy, model, optimizer)")
    amp.iteration.refuse_watch()  # its first record would miss what ran before: nothing installed
    if amp.distributed is not None and amp.distributed.get("engine") == "fsdp2":
        raise UnsupportedError("amp.watch(): not available on an FSDP2-sharded model yet (its parameters and "
                               "gradients are shards); watch a data-parallel (amp.ddp()) or single-device run")
    watch = TorchWatch(amp, session)
    session.bind(watch.step, watch.close)
    amp._watching = watch
    amp.iteration.watch(watch)
    try:
        watch.arm()
    except BaseException:
        watch.close()
        raise
    return watch


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

