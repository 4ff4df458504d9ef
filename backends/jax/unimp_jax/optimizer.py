"""The optimizer wrappers: loss-scale state and fp32 master weights inside the optimizer state.

:func:`amp_tx` (the Plan's loss scale and masters; public form :func:`unimp_jax.wrap`) is an
``optax.GradientTransformation``. Its state is :class:`AmpOptState` (inner optax state, the canonical
:class:`~unimp_jax.scaler.DeviceLossScale`, fp32 masters or None), so it checkpoints with the optimizer.
``update`` takes *unscaled* gradients (from ``amp.value_and_grad``), checks them, and on a skipped step
returns ``-0.0`` updates (the exact identity under ``optax.apply_updates``) and the old inner state and
masters, bit for bit. :class:`AmpOptimizer` is the ``nnx.Optimizer`` over it (``amp.optimizer``, nnx).

>>> import jax.numpy as jnp, optax, unimp, unimp_jax
>>> tx = unimp_jax.wrap(optax.sgd(0.5), unimp.load("mixed_fp16"))
>>> params = {"w": jnp.ones(2)}
>>> state = tx.init(params)
>>> updates, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state, params)
>>> apply_updates(params, updates, state)["w"].tolist(), int(state.loss_scale.skipped)
([1.0, 1.0], 1)
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from unimp.spi import LossScaleSpec

from . import fp8
from .layers import is_float
from .scaler import DeviceLossScale, initial_tree, update_tree


class AmpOptState(NamedTuple):
    """The wrapper's optimizer state: ``inner`` optax state, ``loss_scale``, fp32 ``master`` or None."""

    inner: Any
    loss_scale: DeviceLossScale
    master: Any


# tx.update -> {(loss-scale spec, masters): weak reference to the wrapped update}: holds nothing alive (the
# wrapped functions close over tx, so a strong value would keep its own key alive)
_WRAPPED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, bool], weakref.ref]] = weakref.WeakKeyDictionary()


def all_finite(tree: Any) -> Any:
    """One bool scalar: every floating leaf of ``tree`` is finite (jit-able, no host sync)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if is_float(x)]
    return jnp.stack(flags).all() if flags else jnp.asarray(True)


def _select(pred: Any, new: Any, old: Any) -> Any:
    return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), new, old)


def amp_tx(tx: Any, spec: LossScaleSpec, masters: bool) -> Any:
    """``tx`` under the loss-scale rule ``spec`` (as it runs here), with fp32 masters or not (memoised per
    tx, spec and masters: equal Plans reuse compiled steps)."""
    try:
        memo = _WRAPPED.setdefault(tx.update, {})
    except TypeError:  # an update function that takes no weak reference: not memoised
        memo = {}
    ref = memo.get((spec, masters))
    update = ref() if ref is not None else None
    if update is None or update.unimp_wraps is not tx:
        update = _build(tx, spec, masters).update
        memo[(spec, masters)] = weakref.ref(update)
    return optax.GradientTransformation(update.unimp_init, update)


def may_skip(tx: Any) -> bool:
    """Whether the transformation ``tx`` (from :func:`amp_tx`) can skip a step (unknown tx: True)."""
    return getattr(getattr(tx, "update", None), "unimp_may_skip", True)


def _build(tx: Any, spec: LossScaleSpec, masters: bool) -> Any:
    # mode none/static without skip_nonfinite never skips: no finiteness check, no selects
    checks = spec.skip_nonfinite or spec.mode == "dynamic"
    f32 = jnp.float32

    def init(params: Any) -> AmpOptState:
        params = fp8.split(params)[0]
        # a copy even where a param is float32 already (norms): donating both must not donate one buffer twice
        master = jax.tree_util.tree_map(lambda p: jnp.array(p, f32, copy=True) if is_float(p) else p,
                                        params) if masters else None
        return AmpOptState(tx.init(master if masters else params), initial_tree(spec), master)

    def update(grads: Any, state: AmpOptState, params: Any = None, **extra: Any) -> tuple[Any, AmpOptState]:
        grads, new_fp8 = fp8.split(grads)
        params, old_fp8 = fp8.split(params)
        if new_fp8 is None:
            return core(grads, state, params, **extra)[:2]
        u, st, applied = core(grads, state, params, **extra)
        # linen delayed FP8 state: the "update" is the new state itself, written by amp.apply_updates
        new = new_fp8 if old_fp8 is None else _select(applied, new_fp8, old_fp8)
        return {"params": u, fp8.OWG: new}, st

    def core(grads: Any, state: AmpOptState, params: Any = None, **extra: Any) -> tuple[Any, AmpOptState, Any]:
        if not isinstance(state, AmpOptState):
            raise TypeError(f"unimp optimizer: state is {type(state).__name__}, expected the AmpOptState "
                            f"from this transformation's init(); fix: opt_state = amp.optimizer.init(params)")
        if masters and params is None:
            raise ValueError("unimp optimizer: update(grads, state, params) needs params when master "
                             "weights are on; fix: pass the model's params as the third argument")
        finite = all_finite(grads) if checks else jnp.asarray(True)
        if masters:
            base = state.master
            g = jax.tree_util.tree_map(lambda x: x.astype(f32) if is_float(x) else x, grads)
        else:
            base = params
            g = grads if params is None else jax.tree_util.tree_map(
                lambda x, p: x.astype(p.dtype) if is_float(x) and is_float(p) else x, grads, params)
        u, inner = tx.update(g, state.inner, base, **extra)
        master = state.master
        if masters:
            master = optax.apply_updates(base, u)
            u = jax.tree_util.tree_map(
                lambda m, p: m.astype(p.dtype).astype(f32) - p.astype(f32) if is_float(p) else m,
                master, params)
        loss_scale = update_tree(spec, state.loss_scale, finite)
        apply = jnp.asarray(True)
        if checks:
            apply = jnp.logical_or(finite, not spec.skip_nonfinite) & ~loss_scale.at_min_error
            inner = _select(apply, inner, state.inner)
            if masters:
                master = _select(apply, master, state.master)
            u = jax.tree_util.tree_map(
                lambda x: jnp.where(apply, x, jnp.asarray(-0.0, x.dtype)) if is_float(x) else x, u)
        return u, AmpOptState(inner, loss_scale, master), apply

    update.unimp_init = init  # type: ignore[attr-defined]  # what wrap() rebuilds the transformation from
    update.unimp_wraps = tx  # type: ignore[attr-defined]
    update.unimp_may_skip = checks  # type: ignore[attr-defined]  # read by may_skip()
    return optax.GradientTransformation(init, update)


def find_state(holder: Any) -> AmpOptState:
    """The :class:`AmpOptState` inside an optax state, an nnx Optimizer, or the state itself."""
    if isinstance(holder, AmpOptState):
        return holder
    tree = holder
    if hasattr(holder, "opt_state") and hasattr(holder, "tx"):  # nnx.Optimizer
        tree = nnx.as_pure(holder.opt_state)
    found = [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, AmpOptState))
             if isinstance(x, AmpOptState)]
    if len(found) != 1:
        raise TypeError(
            f"unimp: found {len(found)} unimp optimizer states in the {type(holder).__name__} given; "
            f"fix: pass the optimizer state made by amp.optimizer.init(params) (linen) or amp.optimizer "
            f"(nnx)")
    return found[0]


def apply_updates(params: Any, updates: Any, opt_state: Any) -> Any:
    """New params: ``cast(master)`` where fp32 masters are kept (bit-exact), else ``params + updates``.

    ``optax.apply_updates`` also works; with masters it is within rounding of ``cast(master)`` but
    only this function guarantees ``params == cast(master)`` bit for bit.
    """
    params, _ = fp8.split(params)
    if isinstance(updates, dict) and fp8.OWG in updates:  # linen delayed FP8: the new state replaces the old
        return {"params": apply_updates(params, updates["params"], opt_state), fp8.OWG: updates[fp8.OWG]}
    state = find_state(opt_state)
    if state.master is None:
        return optax.apply_updates(params, updates)
    return jax.tree_util.tree_map(lambda m, p: m.astype(p.dtype) if is_float(p) else p,
                                  state.master, params)


class AmpOptimizer(nnx.Optimizer):
    """``nnx.Optimizer`` whose ``update`` is exact with masters and counts only applied steps."""

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        params = nnx.as_pure(nnx.state(model, self.wrt))
        grad_arrays = nnx.as_pure(nnx.state(grads, self.wrt))
        old = nnx.as_pure(self.opt_state)
        updates, new = self.tx.update(grad_arrays, old, params, **nnx.as_pure(kwargs))
        nnx.update(model, apply_updates(params, updates, new))
        nnx.update(self.opt_state, nnx.state(new))
        if not may_skip(self.tx):  # no loss scaling and no skipping: every step applies, as nnx.Optimizer
            self.step[...] += 1
            fp8.nnx_write_state(model, grads, True)
            return updates
        before, after = find_state(old).loss_scale, find_state(new).loss_scale
        applied = (after.skipped == before.skipped) & ~after.at_min_error
        self.step[...] += applied.astype(self.step[...].dtype)
        fp8.nnx_write_state(model, grads, applied)  # delayed FP8 scaling state, on applied steps only
        return updates
