"""``amp.watch()`` for Paddle dygraph: per-layer numerics on sampled steps, and where a skipped step's first
non-finite value appeared. The records, their order and the writers are the core's (:class:`unimp.watch.Watch`,
handed to :meth:`PaddleAmp._start_watch`); this module measures, as unimp_torch's watch does in eager.

Hooks on the report's layers (every sublayer of the model; the model itself aside: its output is the
loss or its last layer's): a forward pre-hook (``Layer.register_forward_pre_hook``, the layer's inputs),
a forward post-hook (its output) and, on the output, a gradient hook (``Tensor.register_hook``: the
gradient arriving there); with ``localize``, each input the layer takes is replaced by a view only it
uses, whose gradient hook sees the gradient the layer's backward produced for it. Positions are the order
the hooks run in (forward: the layers' returns; backward: the gradients' arrival). A check is one float32
sum per tensor (non-finite iff a value is), kept on the device; on sampled steps the layer's output and
output gradient are also measured: the largest finite magnitude and the class counts of
:data:`unimp.watch.records.AT_LEAST` in the layer's compute dtype (the Plan's; a tensor already
narrower: its own) against :func:`unimp.spi.dtypes.limits`. The host reads them once, at the end of a
step that is sampled or skipped (``amp.optimizer.step()`` reads the skip flag anyway).

A step is a training iteration: the update of the loss scale the Amp's optimizers share
(:mod:`unimp.loss_scale.iteration`), which a watch listens to (:mod:`unimp.watch.iteration`). With several
optimizers (``unimp.apply(policy, model, [opt_a, opt_b])``, ``amp.add_optimizer(opt)``) one record covers
the forwards and backwards of the whole iteration, whichever optimizer steps first, and a step is skipped
when some optimizer skipped (the scale backed off); a watch started mid-iteration is refused.

The hooks are installed only for the steps that use them (sampled steps, every step with ``localize``):
an unwatched step runs no hook at all. A no-grad forward (evaluation, ``amp.report(x)``) is not measured.
Static-graph Programs (:class:`unimp_paddle.static.PaddleStaticAmp`) have no per-layer hook: refused.

>>> import paddle, unimp
>>> model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.ReLU(), paddle.nn.Linear(4, 1))
>>> amp = unimp.apply({"extends": "mixed_fp16", "on_unsupported": "fallback"}, model,  # CPU: float32 kernels
...                   paddle.optimizer.SGD(parameters=model.parameters()))
>>> watch = amp.watch(every=2)
>>> for _ in range(3):
...     amp.backward(amp.model(paddle.randn([8, 4])).astype("float32").square().mean())
...     _ = amp.optimizer.step(); amp.optimizer.clear_grad()
>>> [r["step"] for r in watch.records], watch.records[0]["layers"][0]["path"]
([0, 2], '0')
>>> _ = amp.remove()
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import numpy as np

from unimp.spi import UnsupportedError, dtypes

from .index import layer_kind

# a layer's checked tensors: slot = 4 * layer + place
IN, OUT, GRAD_OUT, GRAD_IN = range(4)
PLACES = ("input", "output", "grad_output", "grad_input")
LOSS_PATH = "<loss>"


def _floating(leaves: list[Any]) -> list[Any]:
    import paddle

    return [t for t in leaves if isinstance(t, paddle.Tensor) and t.is_floating_point() and t.size]


def _leaves(x: Any) -> list[Any]:
    import paddle

    return [x] if isinstance(x, paddle.Tensor) else list(paddle.utils.flatten(x))


class _Hook:
    """One of a layer's hooks: calls ``fn`` (a method of :class:`PaddleWatch`) with the layer's first slot.
    A copy of the model (``copy.deepcopy``, pickle) gets an inert hook: a copy is not watched."""

    def __init__(self, fn: Any, base: int) -> None:
        self.fn, self.base = fn, base

    def __call__(self, *args: Any) -> Any:
        return self.fn(self.base, *args)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert

    def __reduce__(self) -> tuple[Any, ...]:
        return (_inert_hook, ())


def _inert(*args: Any) -> None:
    """What a copy of a watched model holds in place of the watch's hooks: nothing happens."""
    return None


def _inert_hook() -> Any:
    return _inert


class PaddleWatch:
    """The device side of one :class:`unimp.watch.Watch` on one :class:`PaddleAmp`."""

    def __init__(self, amp: Any, session: Any) -> None:
        self.amp, self.session = amp, session
        self.localize = session.localize
        model = amp._layer
        self.layers = list(model.named_sublayers())
        self.paths = [p for p, _ in self.layers]
        # each layer's compute dtype as the Plan decides it (None: it follows its inputs)
        self.compute = [amp.plan.decide(p, layer_kind(m), (type(m).__name__,)).compute_dtype for p, m in self.layers]
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.order: list[int] = []  # the slots checked this step, first occurrence, in execution order
        self.seen: set[int] = set()
        self.pending: list[tuple[int, Any]] = []  # (slot, float32 sum) per check of the step
        self.checked: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.measures: dict[int, tuple[Any, Any, str]] = {}  # slot -> (amax, counts, target), on the device
        self.measured: dict[int, tuple[Any, int, str]] = {}  # id -> (weak tensor, slot, target)
        self.same: dict[int, int] = {}  # slot -> the slot that measured the same tensor this step
        self.losses: list[Any] = []
        self.scale_used: float | None = None
        self.backward_order = list(reversed(self.paths))  # until a backward is seen
        self.sampling = self.checking = False
        self.handles: list[Any] = []
        self.step = amp.scaler.state().steps  # the index of the next step

    # ------------------------------------------------------------------ install
    def arm(self) -> None:
        """Hooks for the next step: installed when it is sampled (or always with ``localize``), else none."""
        self.sampling = self.session.sampled(self.step)
        self.checking = self.sampling or self.localize
        if self.checking and not self.handles:
            for i, (_, layer) in enumerate(self.layers):
                self.handles += [layer.register_forward_pre_hook(_Hook(self._pre, 4 * i), with_kwargs=True),
                                 layer.register_forward_post_hook(_Hook(self._post, 4 * i))]
        elif not self.checking and self.handles:
            self.disarm()

    def disarm(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    # ------------------------------------------------------------------ per hook, on the device
    def _check(self, slot: int, tensors: list[Any], measured: Any = None) -> None:
        """Check ``tensors`` (a float32 sum each, kept on the device until the step is read; ``measured``:
        checked by its counts instead; a tensor already checked this step is not summed again) and note
        the slot's position in the step."""
        import paddle

        for t in tensors:
            if self.checked.get(id(t)) is not t:
                self.checked[id(t)] = t
                if t is not measured:
                    self.pending.append((slot, paddle.sum(t.detach(), dtype="float32")))
        if slot not in self.seen:
            self.seen.add(slot)
            self.order.append(slot)

    def _measure(self, slot: int, t: Any) -> None:
        """amax and class counts of ``t`` in its target dtype (:meth:`_target`); a tensor measured already
        this step in the same dtype (a container returning its last child's output) is not measured again."""
        target = self._target(slot // 4, t)
        seen = self.measured.get(id(t))
        if seen is not None and seen[0]() is t and seen[2] == target:
            self.same[slot] = seen[1]
            return
        self.measured[id(t)] = (weakref.ref(t), slot, target)
        amax, counts = _amax_and_counts(t, target)
        if slot in self.measures:  # a layer called twice in the step: the largest amax, the counts summed
            import paddle

            amax, counts = paddle.maximum(self.measures[slot][0], amax), self.measures[slot][1] + counts
        self.measures[slot] = (amax, counts, target)

    def _target(self, layer: int, t: Any) -> str:
        """The dtype ``t`` is measured in: its layer's compute dtype where ``t`` is wider (a float32 output
        of a layer that computed in float16), else its own."""
        own, compute = dtypes.dtype_name(t.dtype), self.compute[layer]
        return compute if compute in ("float16", "bfloat16") and t.element_size() > 2 else own

    def _pre(self, base: int, layer: Any, args: tuple, kwargs: dict) -> Any:
        import paddle

        if not self.checking or not paddle.is_grad_enabled():  # a no-grad forward (evaluation, amp.report(x))
            return None
        floating = _floating(_leaves((args, kwargs)))
        if not floating:
            return None
        self._check(base + IN, floating)
        if not self.localize:
            return None
        # each input tensor the layer takes, as a view only it uses: the gradient its backward produces for it
        hook = functools.partial(self._grad_input, base)

        def tap(t: Any) -> Any:
            if isinstance(t, paddle.Tensor) and t.is_floating_point() and not t.stop_gradient:
                t = t.view(t.shape)
                t.register_hook(hook)
            return t

        return tuple(tap(a) for a in args), {k: tap(v) for k, v in kwargs.items()}

    def _post(self, base: int, layer: Any, args: tuple, output: Any) -> None:
        import paddle

        if not self.checking or not paddle.is_grad_enabled():
            return None
        floating = _floating(_leaves(output))
        if not floating:
            return None
        main = floating[0]
        if self.sampling:
            self._measure(base + OUT, main)
        self._check(base + OUT, floating, measured=main if self.sampling else None)
        if not main.stop_gradient:
            main.register_hook(functools.partial(self._grad_output, base))
        return None

    def _grad_output(self, base: int, grad: Any) -> None:
        if self.sampling:
            self._measure(base + GRAD_OUT, grad)
        self._check(base + GRAD_OUT, [grad], measured=grad if self.sampling else None)

    def _grad_input(self, base: int, grad: Any) -> None:
        self._check(base + GRAD_IN, [grad])

    # ------------------------------------------------------------------ per step, on the host
    def loss(self, loss: Any) -> None:
        """``amp.backward(loss)`` / ``amp.scale_loss(loss)``: the loss and the scale it is scaled by."""
        self.losses.append(loss.detach())
        self.scale_used = self.amp.scaler.state().scale if self.amp._scaling else 1.0

    def step_end(self, found: dict[Any, bool | None]) -> None:
        """The iteration ended (the shared loss scale's update, from ``found``: each optimizer stepped since the
        last update -> whether its gradients were all finite): record it if it was sampled or skipped (some
        optimizer skipped), then arm the next."""
        try:
            skipped = self.amp.scaler.spec.skip_nonfinite and not all(f for f in found.values() if f is not None)
            if self.sampling or skipped:
                self._record(skipped)
        finally:
            self._reset()
            self.step = self.amp.scaler.state().steps
            self.arm()

    def _reset(self) -> None:
        self.order.clear()
        self.seen.clear()
        self.pending.clear()
        self.checked.clear()
        self.measures.clear()
        self.measured.clear()
        self.same.clear()
        self.losses.clear()
        self.scale_used = None

    def _read(self) -> tuple[dict[int, float], dict[int, float], dict[int, tuple[float, list[int], str]]]:
        """The step as the host sees it, in one read of each kind: positions (slot -> place in its pass),
        the check sums per slot, and the measured amax, counts and dtype per slot."""
        import paddle

        flags: dict[int, float] = {}
        if self.pending:
            sums = paddle.stack([s for _, s in self.pending]).numpy().tolist()
            for (slot, _), s in zip(self.pending, sums, strict=True):
                flags[slot] = flags.get(slot, 0.0) + s
        stats: dict[int, tuple[float, list[int], str]] = {}
        if self.measures:
            slots = list(self.measures)
            amax = paddle.stack([self.measures[s][0] for s in slots]).numpy().tolist()
            counts = paddle.stack([self.measures[s][1] for s in slots]).numpy().tolist()
            stats = {s: (a, c, self.measures[s][2]) for s, a, c in zip(slots, amax, counts, strict=True)}
        for slot, src in self.same.items():  # the same tensor measured once for two layers
            stats[slot] = stats[src]
        return {slot: float(i) for i, slot in enumerate(self.order)}, flags, stats

    def _record(self, skipped: bool) -> None:
        positions, flags, stats = self._read() if self.checking else ({}, {}, {})
        # finite: its sum is, and (measured) its counts have no non-finite value (AT_LEAST[4])
        events: list[tuple[str, str, float | None, bool]] = [(self.paths[slot // 4], PLACES[slot % 4], pos,
                   _finite(flags.get(slot, 0.0)) and not (slot in stats and stats[slot][1][4]))
                  for slot, pos in positions.items()]
        if skipped:
            events += self._loss_and_params()
        arrivals = sorted((pos, self.paths[slot // 4]) for slot, pos in positions.items() if slot % 4 == GRAD_OUT)
        if arrivals:  # the gradient-arrival order this step saw (for later steps located by parameters only)
            self.backward_order = list(dict.fromkeys(p for _, p in arrivals))

        def order(slot: int) -> tuple[bool, float]:  # the forward as the layers returned, then the backward
            return slot % 4 == GRAD_OUT, positions.get(slot, 0.0)

        layers = [(self.paths[slot // 4], PLACES[slot % 4], stats[slot][2], stats[slot][0], stats[slot][1])
                  for slot in sorted(stats, key=order)] if self.sampling else []
        self.session.add(self.step, skipped=skipped, scale=self.scale_used, sampled=self.sampling, layers=layers,
                         events=events, backward_order=self.backward_order)

    def _loss_and_params(self) -> list[tuple[str, str, float | None, bool]]:
        """A skipped step: the scaled loss and every parameter gradient it left (of every optimizer of the Amp),
        checked in one host read."""
        import paddle

        grads = [(self.names.get(id(p), ""), p.grad) for opt in self.amp.optimizers for p in opt._params
                 if p.grad is not None]
        scale = self.scale_used if self.scale_used is not None else 1.0
        sums = [(paddle.sum(loss, dtype="float32") * scale).reshape([]) for loss in self.losses]
        sums += [paddle.sum(g.detach(), dtype="float32").reshape([]) for _, g in grads]
        if not sums:
            return []
        finite = paddle.isfinite(paddle.stack(sums)).numpy().tolist()
        out: list[tuple[str, str, float | None, bool]] = []
        if self.losses:
            out.append((LOSS_PATH, "loss", None, all(finite[:len(self.losses)])))
        for (name, _), ok in zip(grads, finite[len(self.losses):], strict=True):
            out.append((name.rpartition(".")[0], "grad_param", None, ok))
        return out

    def close(self) -> None:
        """Undo: hooks removed, the Amp's and the optimizer's references cleared (``watch.close()``,
        ``amp.unwatch()``, ``amp.remove()``)."""
        self.checking = self.sampling = False
        self.disarm()
        self._reset()
        if self.amp._watching is self:
            self.amp._watching = None
        self.amp.iteration.unwatch(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None  # a copy of the Amp is not watched


@functools.cache
def _bounds(wide: str, target: str) -> tuple[float, ...]:
    """The magnitudes, in the dtype ``wide`` the counts compare in (float32 or float64: every value of a
    narrower tensor is exact there), from which a cast to ``target`` changes class: the smallest above zero,
    above ``underflow_at``, at or above ``normal_from``, at or above ``overflow_at``, and +inf
    (:class:`unimp.spi.dtypes.Limits`); counting ``|x| >= bound`` for each gives :data:`AT_LEAST` but NaN."""
    lim = dtypes.limits(target)
    kind = np.dtype(wide).type

    def at_least(value: float, strict: bool = False) -> float:
        """The smallest ``wide`` value >= ``value`` (``strict``: > ``value``)."""
        with np.errstate(over="ignore"):  # a bound past ``wide``'s max is +inf there
            v = kind(value)
        if float(v) < value or (strict and float(v) == value):
            v = np.nextafter(v, kind(np.inf))
        return float(v)

    return (at_least(0.0, strict=True), at_least(lim.underflow_at, strict=True), at_least(lim.normal_from),
            at_least(lim.overflow_at), float("inf"))


def _amax_and_counts(t: Any, target: str) -> tuple[Any, Any]:
    """The largest finite magnitude of ``t`` (float32) and the counts :data:`AT_LEAST` (int64, 7: how many
    magnitudes reach each class boundary of ``target``, how many are NaN, numel), on the device."""
    import paddle

    wide = "float64" if t.dtype == paddle.float64 else "float32"
    with paddle.no_grad(), paddle.amp.auto_cast(enable=False):  # the watch's arithmetic, not the policy's
        x = t.detach().abs().astype(wide)
        nan = paddle.sum(paddle.isnan(x), dtype="int64")
        amax = paddle.nan_to_num(x, 0.0, 0.0, 0.0).max().astype("float32")
        # a NaN compares false: it counts in every class up to and including "not finite", as its bit pattern does
        counts = [paddle.sum(x >= b, dtype="int64") + nan for b in _bounds(wide, target)]
        counts += [nan, paddle.full([], x.size, dtype="int64")]
        return amax, paddle.stack(counts)


def _finite(x: float) -> bool:
    return x - x == 0.0  # False for inf and NaN


def start(amp: Any, session: Any) -> PaddleWatch:
    """``amp.watch(...)``: bind ``session`` (the core's :class:`unimp.watch.Watch`) to the :class:`PaddleAmp`
    ``amp``; returns the device side."""
    if amp.optimizer is None:
        raise UnsupportedError("amp.watch(): a watch counts training steps through amp.optimizer.step(); apply the "
                               "policy with the optimizer: amp = unimp.apply(policy, model, optimizer)")
    amp.iteration.refuse_watch()  # its first record would miss what ran before: nothing installed
    watch = PaddleWatch(amp, session)
    session.bind(watch.step, watch.close)
    amp._watching = watch
    amp.iteration.watch(watch)
    try:
        watch.arm()
    except BaseException:
        watch.close()
        raise
    return watch


def visualdl(logdir: Any) -> Any:
    """VisualDL's writer (``visualdl.LogWriter``, Paddle's TensorBoard) at ``logdir``, for the core's
    :class:`~unimp.watch.writer.ScalarWriter` (same tags as every framework)."""
    try:
        from visualdl import LogWriter
    except ImportError as e:
        raise UnsupportedError(f"amp.watch(tensorboard={str(logdir)!r:.60}): Paddle's writer is VisualDL, which is "
                               f"not installed ({e}); pip install visualdl, or use path= (JSON lines)") from None
    return LogWriter(logdir=str(logdir))
