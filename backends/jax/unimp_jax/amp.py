"""What nnx and linen Amps share: the wrapped optax transformation, loss-scaled gradients, state.

``amp.value_and_grad(loss_fn)`` returns ``grad_fn(state, *args)``: ``state`` holds the loss
scale (the optax state from ``amp.optimizer.init``, or the nnx Optimizer ``amp.optimizer``);
``args[0]`` is differentiated (an nnx Module w.r.t. its ``nnx.Param``s, or a params pytree). It
returns ``(loss, grads, finite)``: the loss as ``loss_fn`` computed it (never scaled), grads
divided by the scale in float32, and one bool — all inside your jitted step, no host callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unimp.backend import Amp
from unimp.loss_scale import LossScaleState
from unimp.plan import Plan

from .optim import AmpOptState, all_finite, apply_updates, find_state, wrap
from .scaler import check, initial_tree, to_state


class JaxAmp(Amp):
    """Base of :class:`~unimp_jax.nnx_amp.NnxAmp` and :class:`~unimp_jax.linen_amp.LinenAmp`."""

    def __init__(self, plan: Plan, model: Any, tx: Any) -> None:
        super().__init__(plan, model, None)
        self.inner_tx = tx
        self.tx = wrap(tx, plan.policy)

    # ------------------------------------------------------------------ gradients
    def value_and_grad(self, loss_fn: Callable[..., Any], has_aux: bool = False) -> Callable[..., Any]:
        """``grad_fn(state, *args) -> (loss, grads, finite)`` (``((loss, aux), grads, finite)`` with aux)."""
        return make_value_and_grad(self.policy.loss_scale.mode, loss_fn, has_aux)

    def apply_updates(self, params: Any, updates: Any, opt_state: Any) -> Any:
        """New params after ``amp.optimizer.update``: ``cast(master)`` with masters, else ``params + updates``."""
        return apply_updates(params, updates, opt_state)

    # ------------------------------------------------------------------ canonical state
    def _opt_state_holder(self) -> Any:
        raise NotImplementedError

    def loss_scale_state(self) -> LossScaleState:
        tree = find_state(self._opt_state_holder()).loss_scale
        check(tree, self.policy.loss_scale)
        return to_state(tree)

    def _with_loss_scale(self, opt_state: Any, state: LossScaleState) -> Any:
        import jax

        tree = initial_tree(self.policy.loss_scale, state)
        return jax.tree_util.tree_map(
            lambda x: x._replace(loss_scale=tree) if isinstance(x, AmpOptState) else x, opt_state,
            is_leaf=lambda x: isinstance(x, AmpOptState))


def make_value_and_grad(mode: str, loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """The loss-scaled value_and_grad for a policy whose loss-scale mode is ``mode``."""
    import jax
    import jax.numpy as jnp

    def grad_fn(state: Any, target: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
        scale = None if mode == "none" else find_state(state).loss_scale.scale

        def scaled(t: Any, *a: Any, **k: Any) -> tuple[Any, Any]:
            out = loss_fn(t, *a, **k)
            loss = out[0] if has_aux else out
            if getattr(loss, "shape", ()) != ():
                raise ValueError(f"amp.value_and_grad: loss_fn must return a scalar loss (got shape "
                                 f"{loss.shape}); fix: reduce it, e.g. .mean()")
            value = loss if scale is None else loss.astype(jnp.float32) * scale
            return value, out

        if _is_nnx_module(target):
            from flax import nnx

            (_, out), grads = nnx.value_and_grad(scaled, has_aux=True)(target, *args, **kwargs)
        else:
            (_, out), grads = jax.value_and_grad(scaled, has_aux=True)(target, *args, **kwargs)
        if scale is not None:
            grads = jax.tree_util.tree_map(
                lambda g: g.astype(jnp.float32) / scale if jnp.issubdtype(g.dtype, jnp.floating) else g, grads)
        return out, grads, all_finite(grads)

    return grad_fn


def _is_nnx_module(x: Any) -> bool:
    import sys

    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Module)
