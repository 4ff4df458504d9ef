"""The host side of a backend's watch, written once: :class:`EagerWatch`, which a backend subclasses with its hook
calls and device ops. It schedules the hooks, keeps a step's host state, reads the step once at its end and hands
the core's :class:`unimp.watch.Watch` the record's plain tuples.

- **Scheduling** (:meth:`~EagerWatch.arm`): the layers' hooks are installed for the steps that use them (sampled
  steps; every step with ``localize``) and removed for the others, so that an unwatched step runs no hook. A backend
  whose traced code does not see hooks added later sets :attr:`~EagerWatch.compiled`: the hooks then stay
  installed and read :attr:`~EagerWatch.checking` / :attr:`~EagerWatch.sampling` first.
- **Slots**: a layer ``i``'s checked tensors are the slots ``6 * i + place`` (:data:`PLACES`); a hook receives
  ``base = 6 * i``. Eager, a check keeps one float32 sum per tensor (non-finite iff a value is) and notes the slot's
  position (the order the hooks ran in: the layers' returns, the gradients' arrival); a tensor already checked or
  measured this step is not again (a container returning its last child's output).
- **The step's end** (:meth:`~EagerWatch.step_end`, from :mod:`unimp.watch.iteration`): the skip flags read once;
  a step sampled or skipped is read (one host read of the sums and amaxes, one of the counts) and recorded:
  its events (with the loss and the parameter gradients on a skipped step), its gradient-arrival order, its
  measured tensors in execution order; then the state is reset and the next step armed.

A backend supplies (the methods raising :class:`NotImplementedError` here): :meth:`~EagerWatch._install` (a
layer's hooks, :meth:`~EagerWatch._pre` and :meth:`~EagerWatch._post`: handles with ``remove()``),
:meth:`~EagerWatch._inputs`, :meth:`~EagerWatch._outputs`, :meth:`~EagerWatch._tap_input` (a gradient hook on a
layer's input, with ``localize``), :meth:`~EagerWatch._floating`, :meth:`~EagerWatch._grad_enabled`,
:meth:`~EagerWatch._tap_output` (a gradient hook on a layer's output), :meth:`~EagerWatch._sum` (a float32 sum),
:meth:`~EagerWatch._count` (amax and :data:`unimp.watch.records.AT_LEAST` counts of a tensor),
:meth:`~EagerWatch._host` (the host read of a list of device values), :meth:`~EagerWatch._width`,
:meth:`~EagerWatch._skipped`, :meth:`~EagerWatch._param_grads`, :meth:`~EagerWatch._scaled_loss`,
:meth:`~EagerWatch._scale_now` and :meth:`~EagerWatch._steps`.

**A traced path** (taps that run inside a compiled or traced step, where no Python side effect is kept) is the
backend's, through these hooks: :meth:`~EagerWatch._check` and :meth:`~EagerWatch._measure` (write a device buffer
and a device clock's position instead of the host lists while tracing), :meth:`~EagerWatch._tap_output` and
:meth:`~EagerWatch._tap_input` (return a tensor to put in the output's or input's place, whose backward measures
the gradient), :meth:`~EagerWatch._read_traced` (fold the buffers into the step's host read: positions, sums and
measured tensors; a position ``None``: the core mirrors the forward's), :meth:`~EagerWatch._clear_buffers` (zero
them for the next step) and :meth:`~EagerWatch._arming` (e.g. set :attr:`~EagerWatch.compiled` when the model runs
compiled). The scheduling, the record's assembly and the order stay these.

A backend's tensors here are plain lists of floats (sums and reads on the host):

>>> from types import SimpleNamespace
>>> from unimp.watch import Watch
>>> class T(list): pass  # a "tensor"
>>> class Lists(EagerWatch):
...     def _install(self, base, layer): return []
...     def _sum(self, t): return sum(t)
...     def _host(self, values): return list(values)
...     def _skipped(self, flags): return [not f for f in flags]
...     def _param_grads(self): return []
...     def _steps(self): return 0
>>> amp = SimpleNamespace(scaler=SimpleNamespace(spec=SimpleNamespace(skip_nonfinite=True)), optimizers=["sgd"])
>>> session = Watch(every=10)
>>> watch = Lists(amp, session, [("fc1", None), ("fc2", None)], [None, None])
>>> session.bind(watch.step, watch.close); watch.arm()
>>> watch._check(OUT, [T([1.0, 2.0])]); watch._check(6 + OUT, [T([float("inf")])])
>>> watch.step_end({"sgd": False})  # the optimizer's gradients were not finite: skipped
>>> session.records[0]["first_nonfinite"]["path"], session.records[0]["skipped"]
('fc2', True)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from unimp.errors import UnsupportedError
from unimp.spi import dtypes
from unimp.watch.session import Watch

# a layer's checked tensors: slot = 6 * layer + place (WIDTH per layer)
IN, OUT, GRAD_OUT, GRAD_IN, FP8_IN, FP8_GRAD_OUT = range(6)
PLACES = ("input", "output", "grad_output", "grad_input", "fp8_input", "fp8_grad_output")
WIDTH = len(PLACES)
LOSS_PATH = "<loss>"
CODES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")  # a measured tensor's dtype

Stats = dict[int, tuple[int, float, list[int]]]  # slot -> (CODES index, amax, AT_LEAST counts)


def finite(x: float) -> bool:
    """Whether a host value is finite (False for inf and NaN).

    >>> finite(1e308), finite(float("inf")), finite(float("nan"))
    (True, False, False)
    """
    return x - x == 0.0


def fold(stats: Stats, slot: int, code: int, amax: float, counts: Sequence[int]) -> None:
    """Add one measurement of ``slot`` to ``stats``: the largest amax, the counts summed (a layer called twice)."""
    if slot in stats:
        _, before, summed = stats[slot]
        amax, counts = max(before, amax), [a + b for a, b in zip(summed, counts, strict=True)]
    stats[slot] = (code, amax, list(counts))


def _none() -> None:
    return None


class Inert:
    """A hook that does nothing (what a copy of a watched model holds)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


class NotCopied:
    """What the model, the optimizer or the Amp hold while watched: their copies and pickles get ``copied_as``
    instead (a copied model is not watched: its hooks must not write into this watch)."""

    copied_as: Any = None

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.copied_as

    def __reduce__(self) -> tuple[Any, ...]:
        return (_none, ()) if self.copied_as is None else (type(self.copied_as), ())


class Hook(NotCopied):
    """One of a layer's hooks: calls ``fn`` (a method of the watch) with the layer's first slot ``base``."""

    copied_as = Inert()

    def __init__(self, fn: Callable[..., Any], base: int) -> None:
        self.fn, self.base = fn, base

    def __call__(self, *args: Any) -> Any:
        return self.fn(self.base, *args)


class EagerWatch(NotCopied):
    """The device side of one :class:`unimp.watch.Watch` on one Amp: ``layers`` the report's layers (path, layer)
    and ``compute`` each one's compute dtype as the Plan decides it (None: it follows its inputs)."""

    def __init__(self, amp: Any, session: Watch, layers: Sequence[tuple[str, Any]],
                 compute: Sequence[str | None]) -> None:
        self.amp, self.session = amp, session
        self.localize = session.localize
        self.layers = list(layers)
        self.paths = [p for p, _ in self.layers]
        self.compute = list(compute)
        self.loss_slot = WIDTH * len(self.layers)  # the slots of the layers end here
        self.order: list[int] = []  # eager hooks' slots, first occurrence in the step, in execution order
        self.seen: set[int] = set()
        self.pending: list[tuple[int, Any]] = []  # eager checks of the step: (slot, float32 sum)
        # eager measurements of the step: (slot, amax, counts), read when the step is
        self.pending_measures: list[tuple[int, Any, Any]] = []
        self.pending_codes: dict[int, int] = {}  # slot -> CODES index (a host constant)
        self.checked: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.measured: dict[int, tuple[weakref.ref[Any], int, tuple[str, bool]]] = {}  # id -> (tensor, slot, how)
        self.same: dict[int, int] = {}  # slot -> the slot that measured the same tensor this step
        self.losses: list[Any] = []
        self.scale_used: Any = None  # the scale the last loss was scaled by
        self.backward_order: list[str] = list(reversed(self.paths))  # until a backward is seen
        self.sampling = self.checking = False  # read first by every hook
        self.compiled = False  # the hooks stay installed (the model runs traced code that would not see new ones)
        self.handles: list[Any] = []
        self.step = self._steps()  # the index of the next step

    @classmethod
    def begin(cls, amp: Any, session: Watch, *, counted: bool = True) -> Self:
        """``amp.watch(...)``: bind ``session`` to ``amp`` (refused mid-iteration, or where ``amp``'s steps are not
        ``counted``: no optimizer of the Amp; before anything is installed), arm the first step; returns the
        device side (``amp._watching``)."""
        if not counted:
            raise UnsupportedError("amp.watch(): a watch counts training steps through amp.optimizer.step(); apply "
                                   "the policy with the optimizer: amp = unimp.apply(policy, model, optimizer)")
        amp.iteration.refuse_watch()  # its first record would miss what ran before: nothing installed
        watch = cls(amp, session)  # type: ignore[call-arg]  # a backend's __init__ takes (amp, session)
        session.bind(watch.step, watch.close)
        amp._watching = watch
        amp.iteration.watch(watch)
        try:
            watch.arm()
        except BaseException:
            watch.close()
            raise
        return watch

    # ------------------------------------------------------------------ install
    def arm(self) -> None:
        """Hooks for the next step: installed when it is sampled (or always with ``localize``, or for good once
        :attr:`compiled`), else none. None once the watch closed (a full disk under its file closes it from
        inside the step's record)."""
        if self.session.closed:
            return
        self.sampling = self.session.sampled(self.step)
        self.checking = self.sampling or self.localize
        self._arming()
        if (self.checking or self.compiled) and not self.handles:
            for i, (_, layer) in enumerate(self.layers):
                self.handles += self._install(WIDTH * i, layer)
        elif not (self.checking or self.compiled) and self.handles:
            self.disarm()

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ per hook
    def _check(self, slot: int, tensors: Sequence[Any], measured: Any = None) -> None:
        """Check ``tensors`` for non-finite values (a float32 sum each, kept until the host reads the step;
        ``measured``: checked by its counts instead; a tensor already checked this step is not summed again)
        and note the slot's position in the step."""
        for t in tensors:
            if self.checked.get(id(t)) is not t:
                self.checked[id(t)] = t
                if t is not measured:
                    self.pending.append((slot, self._sum(t)))
        if slot not in self.seen:
            self.seen.add(slot)
            self.order.append(slot)

    def _measure(self, slot: int, t: Any, target: str, scaled: bool = False) -> None:
        """amax and class counts of ``t`` in ``target`` (``scaled``: after tensorwise scaling to ``target``'s max,
        as an FP8 cast does); a tensor measured already this step the same way is not measured again."""
        seen = self.measured.get(id(t))
        if seen is not None and seen[0]() is t and seen[2] == (target, scaled):
            self.same[slot] = seen[1]
            return
        self.measured[id(t)] = (weakref.ref(t), slot, (target, scaled))
        amax, counts = self._count(t, target, scaled)
        self.pending_measures.append((slot, amax, counts))
        self.pending_codes[slot] = CODES.index(target)

    def _target(self, base: int, t: Any) -> str:
        """The dtype ``t`` is measured in: its layer's compute dtype where ``t`` is wider (a float32 output of a
        layer that computed in float16), else its own."""
        own, compute = dtypes.dtype_name(t.dtype), self.compute[base // WIDTH]
        return compute if compute in ("float16", "bfloat16") and self._width(t) > 2 else own

    def _measure_fp8(self, slot: int, t: Any) -> None:
        """An FP8 layer's tensor at ``slot`` (:data:`FP8_IN`, :data:`FP8_GRAD_OUT`) on a sampled step; none here."""

    def _pre(self, base: int, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A layer's forward pre-hook (with its keyword arguments): its inputs checked; with ``localize``, each
        one it takes replaced by :meth:`_tap_input`'s."""
        if not self.checking or not self._grad_enabled():  # a no-grad forward (evaluation, amp.report(x))
            return None
        leaves, rebuild = self._inputs(args, kwargs)
        floating = self._floating(leaves)
        if not floating:
            return None
        self._check(base + IN, floating)
        if self.sampling:
            self._measure_fp8(base + FP8_IN, floating[0])
        if not self.localize:
            return None
        tapped = [self._tap_input(base, t) for t in leaves]
        return None if all(a is b for a, b in zip(tapped, leaves, strict=True)) else rebuild(tapped)

    def _post(self, base: int, layer: Any, args: Any, output: Any) -> Any:
        """A layer's forward hook: its output checked (its main tensor measured on a sampled step) and the
        gradient arriving there hooked (:meth:`_tap_output`)."""
        if not self.checking or not self._grad_enabled():  # a no-grad forward (evaluation, amp.report(x))
            return None
        leaves, rebuild = self._outputs(output)
        floating = self._floating(leaves)
        if not floating:
            return None
        main = floating[0]
        if self.sampling:
            self._measure(base + OUT, main, self._target(base, main))
        self._check(base + OUT, floating, measured=main if self.sampling else None)
        tapped = self._tap_output(base, main)
        if tapped is None:
            return None
        leaves[leaves.index(main)] = tapped
        return rebuild(leaves)

    def _grad_output(self, base: int, grad: Any) -> None:
        """The gradient arriving at a layer's output (an eager gradient hook)."""
        if self.sampling:
            self._measure(base + GRAD_OUT, grad, self._target(base, grad))
            self._measure_fp8(base + FP8_GRAD_OUT, grad)
        self._check(base + GRAD_OUT, [grad], measured=grad if self.sampling else None)

    def _grad_input(self, base: int, grad: Any) -> None:
        """The gradient a layer's backward produced for one of its inputs (``localize``)."""
        self._check(base + GRAD_IN, [grad])

    # ------------------------------------------------------------------ per step, on the host
    def loss(self, loss: Any) -> None:
        """``amp.backward(loss)`` / ``amp.scale_loss(loss)``: the loss and the scale it is scaled by."""
        self.losses.append(loss.detach())
        self.scale_used = self._scale_now()

    def step_end(self, found: Mapping[Any, Any]) -> None:
        """The iteration ended (the shared loss scale's update, from ``found``: each optimizer stepped since the
        last update -> its flag, None where it has none): record it if it was sampled or skipped (some optimizer
        skipped), then arm the next."""
        try:
            flags = {m: f for m, f in found.items() if f is not None} if self.amp.scaler.spec.skip_nonfinite else {}
            bad = dict(zip(flags, self._skipped(list(flags.values())) if flags else [], strict=True))
            if self.sampling or any(bad.values()):
                self._record(any(bad.values()), self._skipped_elsewhere(bad))
        finally:
            self._reset()
            self.step = self._steps()
            self.arm()

    def _reset(self) -> None:
        self._clear_buffers()
        self.order.clear()
        self.seen.clear()
        self.pending.clear()
        self.pending_measures.clear()
        self.pending_codes.clear()
        self.checked.clear()
        self.measured.clear()
        self.same.clear()
        self.losses.clear()

    def _read(self) -> tuple[dict[int, float | None], dict[int, float], Stats]:
        """The step as the host sees it: positions (slot -> place in its pass), the check sums per slot and the
        measured tensors per slot, in one host read of the sums and amaxes and one of the counts."""
        positions: dict[int, float | None] = {slot: float(i) for i, slot in enumerate(self.order)}
        flags: dict[int, float] = {}
        stats: Stats = {}
        if self.pending or self.pending_measures:
            values = self._host([s for _, s in self.pending] + [a for _, a, _ in self.pending_measures])
            for (slot, _), s in zip(self.pending, values, strict=False):
                flags[slot] = flags.get(slot, 0.0) + s
            if self.pending_measures:
                counted = self._host([c for _, _, c in self.pending_measures])
                for (slot, _, _), a, c in zip(self.pending_measures, values[len(self.pending):], counted, strict=True):
                    fold(stats, slot, self.pending_codes[slot], a, c)
        for slot, src in self.same.items():  # the same tensor measured once for two layers
            if src in stats:
                stats[slot] = stats[src]
        self._read_traced(positions, flags, stats)
        return positions, flags, stats

    def _skipped_elsewhere(self, bad: Mapping[Any, bool]) -> list[str]:
        """A note when only optimizers of other Amps sharing the scale skipped (this model's stepped)."""
        own = set(map(id, self.amp.optimizers))
        if not any(bad.values()) or any(b for m, b in bad.items() if id(m) in own):
            return []
        others = [self._optimizer_label(m) for m, b in bad.items() if b and id(m) not in own]
        return [f"this model's optimizers stepped; the iteration is skipped because another optimizer sharing "
                f"the loss scale had non-finite gradients ({', '.join(others)}): watch that model's Amp to "
                f"locate them"]

    @staticmethod
    def _optimizer_label(member: Any) -> str:
        """How a note names an optimizer wrapper: its optimizer's class and its first parameter's name."""
        names = getattr(member, "names", None) or {}
        return f"{type(getattr(member, 'optimizer', member)).__name__} of {next(iter(names.values()), '?')}"

    def _record(self, skipped: bool, notes: Sequence[str] = ()) -> None:
        scale = float(self.scale_used) if self.scale_used is not None else None
        positions, flags, stats = self._read() if self.checking else ({}, {}, {})
        # finite: its sum is, and (measured) its counts have no non-finite value (AT_LEAST[4])
        events: list[tuple[str, str, float | None, bool]] = [
            (self.paths[slot // WIDTH], PLACES[slot % WIDTH], pos,
             finite(flags.get(slot, 0.0)) and not (slot in stats and stats[slot][2][4]))
            for slot, pos in positions.items() if slot < self.loss_slot and slot % WIDTH < FP8_IN]
        if skipped:
            events += self._loss_and_params()
        arrivals = sorted((pos, self.paths[slot // WIDTH]) for slot, pos in positions.items()
                          if slot % WIDTH == GRAD_OUT and slot < self.loss_slot and pos is not None)
        if arrivals:  # the gradient-arrival order this step saw (for later steps located by parameters only)
            self.backward_order = list(dict.fromkeys(p for _, p in arrivals))
        layers = self._stats(positions, stats) if self.sampling else []
        self.session.add(self.step, skipped=skipped, scale=scale, sampled=self.sampling, layers=layers,
                         events=events, backward_order=self.backward_order, notes=notes)

    def _loss_and_params(self) -> list[tuple[str, str, float | None, bool]]:
        """A skipped step: the scaled loss and every parameter gradient it left (of every optimizer of the Amp),
        checked in one host read."""
        grads = self._param_grads()
        sums = [self._scaled_loss(loss) for loss in self.losses] + [self._sum(g) for _, g in grads]
        if not sums:
            return []
        ok = [finite(s) for s in self._host(sums)]
        out: list[tuple[str, str, float | None, bool]] = []
        if self.losses:
            out.append((LOSS_PATH, "loss", None, all(ok[:len(self.losses)])))
        for (name, _), good in zip(grads, ok[len(self.losses):], strict=True):
            out.append((name.rpartition(".")[0], "grad_param", None, good))
        return out

    def _stats(self, positions: Mapping[int, float | None],
               stats: Stats) -> list[tuple[str, str, str, float, list[int]]]:
        """The measured tensors, in execution order: the forward's as the layers returned, then the backward's
        as the gradients arrived (traced: in the reverse order of the returns); an FP8 tensor next to its
        layer's output or gradient."""
        def order(slot: int) -> tuple[int, float, int]:
            backward = slot % WIDTH in (GRAD_OUT, FP8_GRAD_OUT)
            anchor = slot - slot % WIDTH + (GRAD_OUT if backward else OUT)
            position = positions.get(anchor)
            if position is None and backward:
                position = -(positions.get(anchor - GRAD_OUT + OUT) or 0.0)
            return int(backward), position or 0.0, slot

        return [(self.paths[slot // WIDTH], PLACES[slot % WIDTH], CODES[stats[slot][0]], stats[slot][1],
                 stats[slot][2]) for slot in sorted(stats, key=order)]

    def close(self) -> None:
        """Undo: hooks removed, the step's state dropped, the Amp's reference cleared (``watch.close()``,
        ``amp.unwatch()``, ``amp.remove()``)."""
        self.checking = self.sampling = False
        self.disarm()
        self._reset()
        if self.amp._watching is self:
            self.amp._watching = None
        self.amp.iteration.unwatch(self)

    # ------------------------------------------------------------------ a backend's
    def _install(self, base: int, layer: Any) -> list[Any]:
        """Install ``layer``'s hooks (first slot ``base``), e.g. :meth:`_pre` and :meth:`_post` wrapped in
        :class:`Hook`; returns their handles (each with ``remove()``)."""
        raise NotImplementedError

    def _inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Callable[[list[Any]], Any]]:
        """A layer's inputs as a list of leaves and how to rebuild ``(args, kwargs)`` from them."""
        raise NotImplementedError

    def _tap_input(self, base: int, t: Any) -> Any:
        """With ``localize``: ``t``, one of a layer's input leaves, itself (no gradient to see), or a tensor only the
        layer uses in its place, whose gradient (the one the layer's backward produced) reaches :meth:`_grad_input`
        (eager: a view with a gradient hook)."""
        raise NotImplementedError

    def _outputs(self, output: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
        """A layer's output as a list of leaves and how to rebuild it from them (:meth:`_tap_output` replaced one)."""
        raise NotImplementedError

    def _floating(self, leaves: list[Any]) -> list[Any]:
        """The floating-point tensors among ``leaves`` that have values."""
        raise NotImplementedError

    def _grad_enabled(self) -> bool:
        """Whether the forward records a backward (a no-grad forward is not watched)."""
        raise NotImplementedError

    def _tap_output(self, base: int, t: Any) -> Any:
        """Hook the gradient arriving at ``t``, a layer's output (:meth:`_grad_output`), when it needs one;
        returns None, or a tensor to return in ``t``'s place (a traced tap)."""
        raise NotImplementedError

    def _sum(self, t: Any) -> Any:
        """The float32 sum of ``t`` on its device, 0-d (non-finite iff one of its values is)."""
        raise NotImplementedError

    def _count(self, t: Any, target: str, scaled: bool) -> tuple[Any, Any]:
        """The largest finite magnitude of ``t`` (float32, 0-d) and its counts :data:`unimp.watch.Watch.AT_LEAST`
        (int64, 7) in ``target``, on the device."""
        raise NotImplementedError

    def _host(self, values: list[Any]) -> list[Any]:
        """The host values of ``values`` (0-d or 1-d tensors of one shape and dtype), in one read."""
        raise NotImplementedError

    def _width(self, t: Any) -> int:
        """Bytes per element of ``t``."""
        raise NotImplementedError

    def _skipped(self, flags: list[Any]) -> list[bool]:
        """For each stepped optimizer's flag (``found``'s values), whether it skipped, in one host read."""
        raise NotImplementedError

    def _param_grads(self) -> list[tuple[str, Any]]:
        """Every parameter gradient the step left, of every optimizer of the Amp: (parameter name, tensor)."""
        raise NotImplementedError

    def _scaled_loss(self, loss: Any) -> Any:
        """The float32 sum of ``loss`` times :attr:`scale_used` (set with it by :meth:`loss`), 0-d."""
        raise NotImplementedError

    def _scale_now(self) -> Any:
        """The scale a loss is scaled by now (a host float or a 0-d device value; 1.0 without scaling)."""
        raise NotImplementedError

    def _steps(self) -> int:
        """The index of the next step (the loss scale's step count)."""
        raise NotImplementedError

    def _arming(self) -> None:
        """Before :meth:`arm` installs or removes hooks (``checking`` set): a traced path's flags."""

    def _clear_buffers(self) -> None:
        """Zero a traced path's device buffers for the next step."""

    def _read_traced(self, positions: dict[int, float | None], flags: dict[int, float], stats: Stats) -> None:
        """Fold a traced path's device buffers into the step's host read (positions, sums, measured tensors)."""
