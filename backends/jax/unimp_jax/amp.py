"""What nnx and linen Amps share: the wrapped optax transformation, loss-scaled gradients, state.

``amp.value_and_grad(loss_fn)`` returns ``grad_fn(state, *args)``: ``state`` holds the loss
scale (the optax state from ``amp.optimizer.init``, or the nnx Optimizer ``amp.optimizer``);
``args[0]`` is differentiated (an nnx Module w.r.t. its ``nnx.Param``s, or a params pytree). It
returns ``(loss, grads, finite)``: the loss as ``loss_fn`` computed it (never scaled), grads
divided by the scale in float32, and one bool — all inside your jitted step, no host callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from unimp.spi import Amp, LossScaleState, Plan, StateError, UnsupportedError

from . import distributed, fp8
from .layers import LayerPlan, is_nnx
from .optimizer import AmpOptState, all_finite, amp_tx, apply_updates, find_state
from .scaler import check, initial_tree, to_state


class JaxAmp(Amp):
    """Base of :class:`~unimp_jax.nnx_amp.NnxAmp` and :class:`~unimp_jax.linen_amp.LinenAmp`."""

    def __init__(self, plan: Plan, model: Any, tx: Any) -> None:
        """``plan``: indexed on ``model`` (the subclass indexes it when compiled without it)."""
        super().__init__(plan, model, None)
        self.findings = list(plan.layout.act("jax", stacklevel=5))  # "error": raised before any change
        self.inner_tx = tx
        self.tx = amp_tx(tx, plan.loss_scale, plan.uses_master_weights)  # the Plan's loss scale, as it runs
        self.layers: dict[str, LayerPlan] = {}
        self.fp8_decisions: list[Any] = []  # unimp.spi.Fp8Decision per layer FP8 was asked of
        self._watching: Any = None  # unimp_jax.watch.JaxWatch while amp.watch() runs

    def _layer(self, info: Any) -> LayerPlan:
        """The indexed layer ``info`` under the Plan (its FP8 recipe included), kept in ``amp.layers``."""
        lp = LayerPlan.of(self.plan, info)
        self.layers[info.path] = lp = fp8.layer_plan(self.plan, lp, info.dims, self.fp8_decisions)
        return lp

    # ------------------------------------------------------------------ gradients
    def value_and_grad(self, loss_fn: Callable[..., Any], has_aux: bool = False,
                       axis_name: Any = None, numerics: bool = False) -> Callable[..., Any]:
        """``grad_fn(state, *args) -> (loss, grads, finite)`` (``((loss, aux), grads, finite)`` with aux).

        ``axis_name`` (inside ``shard_map``/``pmap``): gradients are all-reduced (mean) over that axis in
        ``distributed.reduce_dtype``, the loss is averaged over it, and ``finite`` is agreed by
        every device (see :mod:`unimp_jax.distributed`). ``numerics`` (while ``amp.watch()`` runs):
        a fourth value, the step's numerics, to hand back with :meth:`record` (:mod:`unimp_jax.watch`).
        """
        def checked(*args: Any, **kwargs: Any) -> Any:  # the loss's dtype is known when it is traced
            out = loss_fn(*args, **kwargs)
            self.check_loss_dtype(str((out[0] if has_aux else out).dtype))
            return out

        watching = None
        if numerics:
            self._check_live("amp.value_and_grad(numerics=True)")
            if self._watching is None:
                raise UnsupportedError("amp.value_and_grad(numerics=True): no watch is running; start one first "
                                       "(watch = amp.watch(every=100)), then make the gradient function")
            if axis_name is not None:
                raise UnsupportedError("amp.value_and_grad(numerics=True, axis_name=...): a watch of a "
                                       "data-parallel step is not available yet; watch a single-device step")
            watching = self._watching
        return make_value_and_grad(self.plan.loss_scale.mode, checked, has_aux, axis_name=axis_name,
                                   reduce_dtype=self.plan.reduce_dtype, watch=watching)

    def record(self, numerics: Any) -> None:
        """Hand a watched step's numerics (from ``amp.value_and_grad(..., numerics=True)``) to the watch.

        The previous step's are read now (that step is done: no wait), and only when it was sampled or
        skipped beyond its two flags; ``watch.close()`` reads the last one. Without a running watch: nothing."""
        self._check_live("amp.record()")
        if self._watching is not None:
            self._watching.record(numerics)

    def _start_watch(self, watch: Any) -> None:
        """``amp.watch(...)`` (the core's): numerics from the jitted step (:mod:`unimp_jax.watch`)."""
        from .watch import start

        start(self, watch)

    def data_parallel(self, step_fn: Callable[..., Any], mesh: Any = None, axis_name: str = "data",
                      donate: bool = True, out_specs: Any = None) -> Callable[..., Any]:
        """``step_fn`` as a jitted data-parallel ``shard_map`` step (:func:`unimp_jax.distributed.data_parallel`)."""
        return distributed.data_parallel(self, step_fn, mesh=mesh, axis_name=axis_name, donate=donate,
                                         out_specs=out_specs)

    def apply_updates(self, params: Any, updates: Any, opt_state: Any) -> Any:
        """New params after ``amp.optimizer.update``: ``cast(master)`` with masters, else ``params + updates``."""
        return apply_updates(params, updates, opt_state)

    # ------------------------------------------------------------------ canonical state
    def _opt_state_holder(self) -> Any:
        raise NotImplementedError

    def fp8_state(self) -> Any:
        """The delayed FP8 scaling state (a pytree; empty when no layer runs delayed FP8)."""
        return {}

    def set_fp8_state(self, tree: Any) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """The canonical state, plus ``fp8``: the delayed FP8 scaling state as plain floats when kept."""
        out = super().state_dict()
        plain = fp8.to_plain(self.fp8_state())
        if plain:
            out["fp8"] = plain
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """As :meth:`unimp.backend.Amp.load_state_dict`; ``fp8`` (when present) is checked first and
        loaded with it, exactly. A state without ``fp8`` leaves this Amp's FP8 scaling state as it is."""
        self._check_live("amp.load_state_dict()")
        new = None
        if isinstance(state, Mapping) and "fp8" in state:
            problems = self.fp8_state_problems(fp8.to_plain(self.fp8_state()), state["fp8"])
            if problems:
                raise StateError("amp.load_state_dict(): " + "; ".join(problems))
            new = fp8.from_plain(self.fp8_state(), state["fp8"])
        super().load_state_dict(state, strict=strict)
        if new is not None:
            self.set_fp8_state(new)

    def loss_scale_state(self) -> LossScaleState:
        tree = find_state(self._opt_state_holder()).loss_scale
        check(tree, self._loss_scale_run())
        return to_state(tree)

    def _with_loss_scale(self, opt_state: Any, state: LossScaleState) -> Any:
        tree = initial_tree(self._loss_scale_run(), state)
        return jax.tree_util.tree_map(
            lambda x: x._replace(loss_scale=tree) if isinstance(x, AmpOptState) else x, opt_state,
            is_leaf=lambda x: isinstance(x, AmpOptState))


def make_value_and_grad(mode: str, loss_fn: Callable[..., Any], has_aux: bool, axis_name: Any = None,
                        reduce_dtype: str = "float32", watch: Any = None) -> Callable[..., Any]:
    """The loss-scaled value_and_grad for a policy whose loss-scale mode is ``mode`` (``watch``: a
    :class:`unimp_jax.watch.JaxWatch`, whose numerics it returns fourth)."""
    def grad_fn(state: Any, target: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        scale = None if mode == "none" else find_state(state).loss_scale.scale
        if axis_name is not None:
            return _distributed(state, target, scale, args, kwargs)
        if watch is not None:
            return _watched(state, target, scale, args, kwargs)
        out, grads = _local(target, scale, args, kwargs)
        if scale is not None:  # FP8 delayed-scaling state (its new value, not a gradient) is not unscaled
            grads = fp8.map_gradients(lambda g: g.astype(jnp.float32) / scale, grads)
        return out, grads, all_finite(fp8.without_state(grads))

    def _watched(state: Any, target: Any, scale: Any, args: tuple, kwargs: dict) -> tuple[Any, ...]:
        from .watch import ROW

        steps = find_state(state).loss_scale.steps
        sampled = watch.sampled(steps)
        probe = jnp.zeros((watch.slots, ROW), jnp.float32)  # its gradient: the backward's rows
        collected = {}

        def observed(t: Any, probe: Any, *a: Any, **k: Any) -> Any:
            with watch.collecting(probe, sampled) as col:
                out = loss_fn(t, *a, **k)
            collected["col"] = col
            return out, col.forward()

        (out, forward), grads, probe_grad = _local(target, scale, args, kwargs, observed, probe)
        if scale is not None:
            grads = fp8.map_gradients(lambda g: g.astype(jnp.float32) / scale, grads)
        finite = all_finite(fp8.without_state(grads))
        loss = out[0] if has_aux else out
        params = [(p, g) for p, g in jax.tree_util.tree_leaves_with_path(grads) if not fp8.is_state_path(p)]
        numerics = watch.numerics(collected["col"].slots, forward, probe_grad, params, finite, loss, scale, steps,
                                  sampled)
        return out, grads, finite, numerics

    def _distributed(state: Any, target: Any, scale: Any, args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
        if is_nnx(target):  # differentiate a device-varying view of the params (local grads)
            replicated = nnx.as_pure(nnx.state(target, nnx.Param))
            nnx.update(target, distributed.to_varying(replicated, axis_name))
            try:
                with fp8.amax_agreed_over(axis_name):
                    out, grads = _local(target, scale, args, kwargs)
            finally:
                nnx.update(target, replicated)
        else:  # the params device-varying; delayed FP8 state stays replicated (its amaxes are agreed)
            view = jax.tree_util.tree_map_with_path(
                lambda p, x: x if fp8.is_state_path(p) else distributed.to_varying(x, axis_name), target)
            with fp8.amax_agreed_over(axis_name):
                out, grads = _local(view, scale, args, kwargs)
        # delayed FP8 state (its new value, identical on every device) is not averaged
        grads = distributed.reduce_gradients(grads, axis_name, reduce_dtype,
                                             out_dtype=None if scale is None else "float32",
                                             skip=fp8.is_state_path)
        if scale is not None:
            grads = fp8.map_gradients(lambda g: g / scale, grads)
        finite = distributed.agree(all_finite(fp8.without_state(grads)), axis_name)
        if has_aux:
            out = (distributed.mean_over(out[0], axis_name), *out[1:])
        else:
            out = distributed.mean_over(out, axis_name)
        return out, grads, finite

    def _local(target: Any, scale: Any, args: tuple, kwargs: dict, observed: Any = None,
               probe: Any = None) -> tuple[Any, ...]:
        """Loss and gradients; ``observed(t, probe, *args)`` (a watch): ``loss_fn`` returning its forward rows
        too, and the probe differentiated with the model (its gradient: the backward's rows)."""
        def scaled(t: Any, *a: Any, **k: Any) -> tuple[Any, Any]:
            out = loss_fn(t, *a, **k) if observed is None else observed(t, *a, **k)
            loss = out if observed is None else out[0]
            loss = loss[0] if has_aux else loss
            if getattr(loss, "shape", ()) != ():
                raise ValueError(f"amp.value_and_grad: loss_fn must return a scalar loss (got shape "
                                 f"{loss.shape}); fix: reduce it, e.g. .mean()")
            value = loss if scale is None else loss.astype(jnp.float32) * scale
            return value, out

        extra = () if probe is None else (probe,)
        argnums: Any = 0 if probe is None else (0, 1)
        if is_nnx(target):
            wrt = nnx.DiffState(0, nnx.Any(nnx.Param, fp8.Fp8State))  # FP8 state: its new value flows back
            argnums = wrt if probe is None else (wrt, 1)
            (_, out), grads = nnx.value_and_grad(scaled, argnums=argnums, has_aux=True)(target, *extra, *args,
                                                                                       **kwargs)
        else:
            (_, out), grads = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)(target, *extra, *args,
                                                                                       **kwargs)
        return (out, grads) if probe is None else (out, *grads)

    return grad_fn

