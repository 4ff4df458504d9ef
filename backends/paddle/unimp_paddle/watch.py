"""``amp.watch()`` for Paddle dygraph: per-layer numerics on sampled steps, and where a skipped step's first
non-finite value appeared. The records, their order and the writers are the core's (:class:`unimp.watch.Watch`),
the hooks' scheduling, the step's host state and the record's assembly :class:`unimp.watch.eager.EagerWatch`'s;
this module measures (Paddle's hooks and device ops).

Hooks on every sublayer of the model (the model itself aside: its output is the loss or its last layer's): a
forward pre-hook (the layer's inputs), a forward post-hook (its output) and, on the output, a gradient hook
(``Tensor.register_hook``); with ``localize``, each input is replaced by a view only the layer uses, whose
gradient hook sees the gradient the layer's backward produced for it. A check is one float32 sum per tensor,
kept on the device; on sampled steps the output and output gradient are also measured: the largest finite
magnitude and the counts of :data:`unimp.watch.records.AT_LEAST` in the layer's compute dtype (a tensor already
narrower: its own). The host reads them once, at the end of a step that is sampled or skipped.

A step is a training iteration: the update of the loss scale the Amp's optimizers share
(:mod:`unimp.loss_scale.iteration`); with several optimizers one record covers the whole iteration, a step is
skipped when some optimizer skipped, and a watch started mid-iteration is refused. An unwatched step runs no
hook; a no-grad forward is not measured. Static-graph Programs have no per-layer hook: refused.

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

from unimp.spi import UnsupportedError, dtypes
from unimp.watch.eager import EagerWatch, Hook
from unimp.watch.traced import thresholds

from .index import layer_kind


def _leaves(x: Any) -> list[Any]:
    import paddle

    return [x] if isinstance(x, paddle.Tensor) else list(paddle.utils.flatten(x))


class PaddleWatch(EagerWatch):
    """The device side of one :class:`unimp.watch.Watch` on one :class:`PaddleAmp`: Paddle's hooks and ops."""

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
        """The largest finite magnitude of ``t`` (float32) and the counts :data:`AT_LEAST` (int64, 7), on the device."""
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
    """The magnitudes in ``wide`` (float32 or float64) from which a cast to ``target`` changes class: the smallest
    above zero, then :func:`unimp.watch.traced.thresholds`; ``|x| >= bound`` counts :data:`AT_LEAST` but NaN."""
    return (dtypes.limits(wide).min_subnormal, *thresholds(target, wide))


def visualdl(logdir: Any) -> Any:
    """VisualDL's writer (``visualdl.LogWriter``, Paddle's TensorBoard) at ``logdir``, for the core's
    :class:`~unimp.watch.writer.ScalarWriter` (same tags as every framework)."""
    try:
        from visualdl import LogWriter
    except ImportError as e:
        raise UnsupportedError(f"amp.watch(tensorboard={str(logdir)!r:.60}): Paddle's writer is VisualDL, which is "
                               f"not installed ({e}); pip install visualdl, or use path= (JSON lines)") from None
    return LogWriter(logdir=str(logdir))
