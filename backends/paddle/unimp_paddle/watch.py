"""``amp.watch()`` for Paddle dygraph: per-layer numerics on sampled steps, and where a skipped step's first
non-finite value appeared. The records, their order and the writers are the core's (:class:`unimp.watch.Watch`,
handed to :meth:`PaddleAmp._start_watch`), the hooks' scheduling, the step's host state and the record's
assembly the core's :class:`unimp.watch.eager.EagerWatch`; this module measures (Paddle's hooks and device ops).

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
from typing import Any

import numpy as np

from unimp.spi import UnsupportedError, dtypes
from unimp.watch.eager import EagerWatch, Hook

from .index import layer_kind


def _leaves(x: Any) -> list[Any]:
    import paddle

    return [x] if isinstance(x, paddle.Tensor) else list(paddle.utils.flatten(x))


class PaddleWatch(EagerWatch):
    """The device side of one :class:`unimp.watch.Watch` on one :class:`PaddleAmp`: Paddle's hooks and device
    ops for :class:`unimp.watch.eager.EagerWatch`."""

    def __init__(self, amp: Any, session: Any) -> None:
        model = amp._layer
        layers = list(model.named_sublayers())
        super().__init__(amp, session, layers,
                         [amp.plan.decide(p, layer_kind(m), (type(m).__name__,)).compute_dtype for p, m in layers])
        self.names = {id(p): name for name, p in model.named_parameters()}

    def _install(self, base: int, layer: Any) -> list[Any]:
        return [layer.register_forward_pre_hook(Hook(self._pre, base), with_kwargs=True),
                layer.register_forward_post_hook(Hook(self._post, base))]

    # ------------------------------------------------------------------ per hook, on the device
    def _inputs(self, args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
        import paddle

        return _leaves((args, kwargs)), lambda new: paddle.utils.pack_sequence_as((args, kwargs), new)

    def _tap_input(self, base: int, t: Any) -> Any:
        import paddle

        if isinstance(t, paddle.Tensor) and t.is_floating_point() and not t.stop_gradient:
            t = t.view(t.shape)
            t.register_hook(functools.partial(self._grad_input, base))
        return t

    def _outputs(self, output: Any) -> tuple[list[Any], Any]:
        return _leaves(output), list  # the output is never replaced (_tap_output hooks it)

    def _floating(self, leaves: list[Any]) -> list[Any]:
        import paddle

        return [t for t in leaves if isinstance(t, paddle.Tensor) and t.is_floating_point() and t.size]

    def _grad_enabled(self) -> bool:
        import paddle

        return paddle.is_grad_enabled()

    def _tap_output(self, base: int, main: Any) -> None:
        if not main.stop_gradient:
            main.register_hook(functools.partial(self._grad_output, base))

    def _sum(self, t: Any) -> Any:
        import paddle

        return paddle.sum(t.detach(), dtype="float32").reshape([])

    def _count(self, t: Any, target: str, scaled: bool) -> tuple[Any, Any]:
        return _amax_and_counts(t, target)

    def _host(self, values: list[Any]) -> list[Any]:
        import paddle

        return paddle.stack(values).numpy().tolist()

    def _width(self, t: Any) -> int:
        return t.element_size()

    # ------------------------------------------------------------------ per step, on the host
    def _scale_now(self) -> float:
        return self.amp.scaler.state().scale if self.amp._scaling else 1.0

    def _steps(self) -> int:
        return self.amp.scaler.state().steps

    def _skipped(self, flags: list[bool]) -> list[bool]:
        return [not f for f in flags]  # the optimizers' flags: whether its gradients were all finite

    def _param_grads(self) -> list[tuple[str, Any]]:
        return [(self.names.get(id(p), ""), p.grad) for opt in self.amp.optimizers for p in opt._params
                if p.grad is not None]

    def _scaled_loss(self, loss: Any) -> Any:
        import paddle

        return (paddle.sum(loss, dtype="float32") * self.scale_used).reshape([])


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


def start(amp: Any, session: Any) -> PaddleWatch:
    """``amp.watch(...)``: bind ``session`` (the core's :class:`unimp.watch.Watch`) to the :class:`PaddleAmp`
    ``amp``; returns the device side."""
    return PaddleWatch.begin(amp, session, counted=amp.optimizer is not None)


def visualdl(logdir: Any) -> Any:
    """VisualDL's writer (``visualdl.LogWriter``, Paddle's TensorBoard) at ``logdir``, for the core's
    :class:`~unimp.watch.writer.ScalarWriter` (same tags as every framework)."""
    try:
        from visualdl import LogWriter
    except ImportError as e:
        raise UnsupportedError(f"amp.watch(tensorboard={str(logdir)!r:.60}): Paddle's writer is VisualDL, which is "
                               f"not installed ({e}); pip install visualdl, or use path= (JSON lines)") from None
    return LogWriter(logdir=str(logdir))
