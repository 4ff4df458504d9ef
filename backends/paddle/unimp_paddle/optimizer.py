"""The optimizer wrapper of the dygraph path: unscale, finiteness check, skip, scale update.

``amp.optimizer.step()`` unscales the gradients (when the loss was scaled), checks them, skips the
inner step on non-finite gradients (nothing of the params, masters or optimizer state changes) and
advances :class:`~unimp_paddle.scaler.TensorLossScale`. Everything else is delegated.
"""

from __future__ import annotations

from typing import Any

from .scaler import TensorLossScale


class AmpOptimizer:
    """Wraps a Paddle optimizer: ``step()``, ``clear_grad()``; other attributes pass through."""

    def __init__(self, inner: Any, scaler: TensorLossScale, params: list[Any]) -> None:
        self._inner = inner
        self._scaler = scaler
        self._params = params
        spec = scaler.spec
        self._scaled = spec.mode != "none"
        self._check = spec.skip_nonfinite or spec.mode == "dynamic"

    @property
    def inner(self) -> Any:
        """The user's Paddle optimizer."""
        return self._inner

    def found_inf(self) -> Any:
        """Unscale grads in place (if scaled) and return a bool tensor [1]: any grad non-finite."""
        import paddle

        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads or not (self._scaled or self._check):
            return paddle.zeros([1], dtype="bool")
        scale = self._scaler.scale if self._scaled else paddle.ones([1], dtype="float32")
        # Paddle's fused kernel (what GradScaler uses): grads /= scale in place, any non-finite -> flag
        _, found_inf = paddle._C_ops.check_finite_and_unscale_(grads, scale)
        return found_inf

    def step(self) -> bool:
        """One optimizer step under the policy; returns True when the step was skipped."""
        inf = self.found_inf()
        skip = bool(self._scaler.update(inf).numpy()[0])
        if not skip:
            self._inner.step()
        return skip

    def clear_grad(self, set_to_zero: bool = True) -> None:
        self._inner.clear_grad(set_to_zero=set_to_zero)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
