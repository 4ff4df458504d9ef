"""The optimizer wrappers: :class:`AmpOptimizer` (dygraph: unscale, finiteness check, skip, scale update) and
:class:`StaticAmpOptimizer` (its static-graph variant: ``minimize`` on the rewritten Program).

``amp.optimizer.step()`` unscales and checks the gradients in one fused Paddle kernel
(``_C_ops.check_finite_and_unscale_``, what ``GradScaler`` runs), reads the flag once (the one host sync
Paddle's ``GradScaler.step`` also makes), skips the inner step on non-finite gradients and advances
:class:`~unimp_paddle.scaler.DeviceLossScale`; with no scaling and no skipping there is no check and no sync.
Under ``amp.data_parallel()`` it first reduces the gradients where Paddle's reducer cannot and agrees the
found-inf flag across ranks (:mod:`unimp_paddle.distributed`).
"""

from __future__ import annotations

from typing import Any

from .iteration import PaddleIteration
from .scaler import DeviceLossScale


class AmpOptimizer:
    """Wraps a Paddle optimizer: ``step()``, ``clear_grad()``; other attributes pass through."""

    def __init__(self, inner: Any, scaler: DeviceLossScale, params: list[Any], iteration: Any = None) -> None:
        self._inner = inner
        self._scaler = scaler
        # the optimizers sharing the scale (unimp.loss_scale.iteration): updated once all of them stepped
        if iteration is None:
            iteration = PaddleIteration(scaler)
        self._iteration = iteration
        iteration.join(self, type(inner).__name__)
        self._params = tuple(params)
        spec = scaler.spec
        self._scaled = spec.mode != "none"
        self._check = spec.skip_nonfinite or spec.mode == "dynamic"
        self._ones: Any = None
        self._group: Any = None
        self._nranks = 1
        self._reduce: Any = None  # distributed.reduce_grads when unimp all-reduces the grads itself
        self._warned = False
        self.masters = False  # the inner optimizer keeps fp32 masters of O2's low parameters (set by the Amp)
        self.in_step = False  # inside step(): the inner optimizer's update is this wrapper's (unimp_paddle.strays)

    def distribute(self, group: Any, nranks: int, reduce: Any = None) -> None:
        """Called by ``amp.data_parallel()``: agree found-inf over ``group``; ``reduce`` the grads."""
        self._group, self._nranks, self._reduce, self._warned = group, nranks, reduce, True

    @property
    def inner(self) -> Any:
        """The user's Paddle optimizer."""
        return self._inner

    @property
    def scaled(self) -> bool:
        """Whether the loss (so this optimizer's gradients) is scaled."""
        return self._scaled

    def own(self, params: list[Any]) -> None:
        """Unscale and check ``params`` only (its own, once another optimizer shares the scale)."""
        self._params = tuple(params)

    def found_inf(self) -> Any:
        """Unscale grads in place (if scaled) and return a bool tensor [1]: any grad non-finite."""
        import paddle

        grads = [g for g in (p.grad for p in self._params) if g is not None]
        if not grads or not (self._scaled or self._check):
            return paddle.zeros([1], dtype="bool")
        if not self._scaled and self._ones is None:
            self._ones = paddle.ones([1], dtype="float32")
        scale = self._scaler.scale if self._scaled else self._ones
        # Paddle's fused kernel (what GradScaler uses): grads /= scale in place, any non-finite -> flag
        _, found_inf = paddle._C_ops.check_finite_and_unscale_(grads, scale)
        return found_inf

    def step(self) -> bool:
        """One optimizer step under the policy (unscaled and checked on this optimizer's parameters, skipped on
        their non-finite gradients); returns True when the step was skipped. The loss scale is updated once
        every optimizer sharing it has stepped."""
        self._iteration.check_step(self, "amp.optimizer.step()")
        if not self._warned:
            self._warn_if_distributed()
        if self._reduce is not None:
            self._reduce(self._params)
        finite = True
        if self._check or self._scaled:
            found = self.found_inf()
            if self._nranks > 1:
                from .distributed import agree_found_inf

                found = agree_found_inf(found, self._group, self._nranks)
            finite = not bool(found.item())
        skip = self._scaler.spec.skip_nonfinite and not finite
        if not skip:
            self.in_step = True
            try:
                self._inner.step()
            finally:
                self.in_step = False
        self._iteration.stepped(self, finite)
        self._iteration.notify()  # the iteration's end, when this step made the scale's update (amp.watch())
        return skip

    def _warn_if_distributed(self) -> None:
        import warnings

        from unimp.spi import UnimpWarning

        from .distributed import world_size

        self._warned = True
        if (self._check or self._scaled) and world_size(None) > 1:
            warnings.warn(
                "unimp (paddle): amp.optimizer.step() in a multi-process job without amp.data_parallel(): "
                "the non-finite decision is local to each rank (ranks may skip different steps) and "
                "distributed.reduce_dtype is not applied. fix: model = amp.data_parallel() instead of "
                "paddle.DataParallel(amp.model)", UnimpWarning, stacklevel=3)

    def clear_grad(self, set_to_zero: bool = True) -> None:
        self._inner.clear_grad(set_to_zero=set_to_zero)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StaticAmpOptimizer:
    """``minimize(loss, startup_program)`` on the rewritten Program (float32 loss, plain backward)."""

    def __init__(self, inner: Any, program: Any) -> None:
        self._inner = inner
        self._program = program

    @property
    def inner(self) -> Any:
        return self._inner

    def minimize(self, loss: Any, startup_program: Any = None) -> Any:
        import paddle

        with paddle.static.program_guard(self._program, startup_program):
            if loss.dtype != paddle.float32:
                loss = loss.astype("float32")
            return self._inner.minimize(loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
