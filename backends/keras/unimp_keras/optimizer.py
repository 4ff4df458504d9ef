"""Optimizer wrappers: loss scaling (the core rule, every knob) and float32 master weights.

:class:`AmpOptimizer` subclasses Keras' ``LossScaleOptimizer`` (so ``compile`` never wraps it again) but runs
unimp's rule (:mod:`unimp_keras.scaler`) on every Keras backend: a stateful ``apply`` (``tf.cond`` in a
TensorFlow graph, a host branch eagerly) and a traceable ``stateless_apply`` (Keras' JAX trainer, inside
``jit``: a skipped step selects the old values). :class:`KerasAmpOptimizer` *is* Keras' rule, plus the
step/skip counters. A skipped step calls nothing on the inner optimizer: every bit is kept.

A saved ``.keras`` file holds what Keras' own classes would (:class:`SavesAsKeras`), plus unimp's exact state.

>>> import keras, unimp
>>> opt = AmpOptimizer(keras.optimizers.SGD(0.1), unimp.load("mixed_fp16").loss_scale)
>>> opt.loss_scale_state().scale  # mixed_fp16's initial = "auto": where Keras' own LossScaleOptimizer starts
32768.0
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.saving import serialization_lib
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils import tracking

from unimp.spi import LossScale, LossScaleSpec, LossScaleState, StateError, dtypes

from .plan import initial_scale
from .scaler import COUNTER, DeviceLossScale, all_finite, held, next_state, to_state

ONLY_FIRST = "only_first_replica"


def _is_tf() -> bool:
    return keras.backend.backend() == "tensorflow"


def _unscale(grads: list, scale: Any, variables: list | None = None) -> list:
    """``grads / scale``, except a Keras float8 scaling variable's new value (``overwrite_with_gradient``)."""
    keep = [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables or ()]
    return [g if scale is None or g is None or (i < len(keep) and keep[i]) else _divided(g, scale)
            for i, g in enumerate(grads)]


def _divided(g: Any, scale: Any) -> Any:
    if type(g).__name__ == "IndexedSlices":  # TensorFlow's sparse gradients (Embedding)
        return type(g)(g.values / ops.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g / ops.cast(scale, g.dtype)


def _dense32(g: Any) -> Any:
    """A gradient as a dense float32 tensor (for a float32 master)."""
    if type(g).__name__ == "IndexedSlices":
        import tensorflow as tf

        g = tf.convert_to_tensor(g)
    return ops.cast(g, "float32")


def _cond(pred: Any, fn: Any) -> None:
    """Run ``fn`` when ``pred``: ``tf.cond`` in a TensorFlow graph, a host branch eagerly."""
    if _is_tf():
        import tensorflow as tf

        if not tf.executing_eagerly():
            tf.cond(pred, fn, lambda: None)
            return
    try:
        take = bool(ops.convert_to_numpy(pred))
    except Exception as e:  # a traced JAX value: the stateful apply cannot branch on it
        raise RuntimeError("unimp AmpOptimizer.apply() under jax.jit: Keras on JAX steps an optimizer "
                           "inside jit with stateless_apply (as model.fit does); fix: call "
                           "optimizer.stateless_apply(optimizer_variables, grads, trainable_variables) in "
                           "your jitted step, or apply() outside jit") from e
    if take:
        fn()


class ExactState(KerasSaveable):
    """unimp's loss-scale state as a child of the optimizer in a saved file (``optimizer/unimp_state``), which
    a loader without unimp never reads."""

    FIELDS = ("scale", "growth_tracker", "hysteresis_left", "skipped", "steps")

    def __init__(self, optimizer: Any) -> None:
        # not an attribute Keras' saver would walk into; alive whenever Keras saves or loads this object
        self._optimizer: Callable[[], Any] = weakref.ref(optimizer)

    def _obj_type(self) -> str:
        return "Loss"  # Keras' saver walks only its own object types; this one has no children

    def save_own_variables(self, store: Any) -> None:
        state = self._optimizer().loss_scale_state()
        for i, name in enumerate(self.FIELDS):
            store[str(i)] = np.asarray(getattr(state, name), "float64" if name == "scale" else "int64")

    def load_own_variables(self, store: Any) -> None:
        if len(store.keys()) == len(self.FIELDS):
            values = DeviceLossScale(*(np.asarray(store[str(i)]) for i in range(len(self.FIELDS))))
            self._optimizer().set_loss_scale_state(to_state(values))


class SavesAsKeras(keras.optimizers.LossScaleOptimizer):
    """What both wrappers share: the ``skipped`` / ``steps`` counters, and a saved file holding the Keras object
    that runs their rule (:meth:`keras_config`) with its variables in that class's order."""

    def __init__(self, inner_optimizer: Any, spec: LossScaleSpec, initial_scale: float, name: str) -> None:
        saved_factor = inner_optimizer.loss_scale_factor
        super().__init__(inner_optimizer, initial_scale=initial_scale, dynamic_growth_steps=spec.growth_interval,
                         name=name)
        self._saved_factor = saved_factor  # Keras clears the inner factor; remove() puts it back
        self.spec = spec
        self.in_step = False  # inside apply: the inner optimizer's step is this wrapper's (unimp_keras.strays)

    def apply(self, grads: list, trainable_variables: list | None = None) -> None:
        """Keras' ``LossScaleOptimizer.apply``, its inner optimizer's step marked as this wrapper's."""
        return self._marked(super().apply, grads, trainable_variables)

    def stateless_apply(self, optimizer_variables: list, grads: list, trainable_variables: list) -> tuple[list, list]:
        """:meth:`_stateless_apply`, its inner optimizer's step marked as this wrapper's (traced under ``jit``)."""
        return self._marked(self._stateless_apply, optimizer_variables, grads, trainable_variables)

    def _marked(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.in_step = True
        try:
            return fn(*args)
        finally:
            self.in_step = False

    def _stateless_apply(self, optimizer_variables: list, grads: list, trainable_variables: list) -> tuple[list, list]:
        """The wrapper's stateless step (Keras' by default; :class:`AmpOptimizer` runs unimp's rule)."""
        return super().stateless_apply(optimizer_variables, grads, trainable_variables)

    @tracking.no_automatic_dependency_tracking
    def _make_exact_state(self) -> None:
        object.__setattr__(self, "unimp_state", ExactState(self))

    @tracking.no_automatic_dependency_tracking
    def _make_counters(self) -> None:
        self._skipped = self.add_variable((), "zeros", COUNTER, aggregation=ONLY_FIRST, name="unimp_skipped")
        self._steps = self.add_variable((), "zeros", COUNTER, aggregation=ONLY_FIRST, name="unimp_steps")

    def _count(self, var: Any) -> None:
        """One more step / skip, saturating at the int32 bound as the core's rule does (never wraps)."""
        var.assign(var + ops.cast(var < dtypes.INT32_MAX, var.dtype))

    def keras_config(self) -> dict[str, Any]:
        """``LossScaleOptimizer``'s config for dynamic scaling, else the inner optimizer's (a static scale: with
        ``loss_scale_factor``)."""
        inner = serialization_lib.serialize_keras_object(self.inner_optimizer)
        if self.spec.mode != "dynamic":
            if self.spec.mode == "static":
                inner["config"]["loss_scale_factor"] = float(self.spec.initial)
            return inner
        return {"module": "keras.optimizers", "class_name": "LossScaleOptimizer", "registered_name": None,
                "config": {"name": self.name, "inner_optimizer": inner, "initial_scale": float(self.spec.initial),
                           "dynamic_growth_steps": int(self.spec.growth_interval)}}

    def _keras_layout(self) -> list[Any]:
        """Keras' own variables for this rule: LossScaleOptimizer's four, then the inner optimizer's."""
        inner = list(self.inner_optimizer.variables)
        if self.spec.mode != "dynamic":
            return inner
        return [self.iterations, self._learning_rate, self.step_counter, self.dynamic_scale, *inner]

    def save_own_variables(self, store: Any) -> None:
        if not self.built:
            return keras.optimizers.Optimizer.save_own_variables(self, store)
        for i, value in enumerate(self._keras_layout()):
            store[str(i)] = value.numpy() if hasattr(value, "numpy") else np.asarray(value)

    def load_own_variables(self, store: Any) -> None:
        layout = self._keras_layout() if self.built else []
        if layout and len(store.keys()) == len(layout) != len(self.variables):
            for i, var in enumerate(layout):
                var.assign(store[str(i)])
            return
        keras.optimizers.Optimizer.load_own_variables(self, store)  # unimp's own layout (older files)


class AmpOptimizer(SavesAsKeras):
    """Loss scaling by unimp's reference rule; ``masters``: ``id(model variable)`` -> its float32 master, which the
    inner optimizer updates (the variable becomes ``cast(master)``; on JAX masters are optimizer variables too)."""

    def __init__(self, inner_optimizer: Any, spec: LossScaleSpec, masters: dict[int, Any] | None = None,
                 name: str | None = None, reduce_dtype: str = "float32") -> None:
        spec = spec.starting_at(initial_scale(), "Keras")  # initial = "auto": where Keras' own starts
        super().__init__(inner_optimizer, spec, LossScale(spec).initial_state().scale, name or "unimp_loss_scale")
        self.reduce_dtype = reduce_dtype  # dtype of the cross-replica gradient sum (tf.distribute)
        self._masters = dict(masters or {})
        self._make_state()
        self._make_exact_state()
        if _is_tf():
            from .tf_distribute import hook_inner

            hook_inner(inner_optimizer)  # this wrapper sums gradients across replicas itself

    @tracking.no_automatic_dependency_tracking
    def _make_state(self) -> None:
        init = LossScale(self.spec).initial_state()
        # under tf.distribute: mirrored, written once in the cross-replica context
        self.dynamic_scale = self.add_variable((), lambda shape, dtype: held(init.scale), "float32",
                                               aggregation=ONLY_FIRST, name="unimp_scale")
        self.step_counter = self.add_variable((), "zeros", COUNTER, aggregation=ONLY_FIRST,
                                              name="unimp_growth_tracker")
        self._hysteresis = self.add_variable((), keras.initializers.Constant(init.hysteresis_left),
                                             COUNTER, aggregation=ONLY_FIRST, name="unimp_hysteresis_left")
        self._make_counters()

    @property
    def variables(self) -> list:
        """Keras' layout (own variables, then the inner optimizer's), on JAX the float32 masters between them."""
        return [*self._variables, *self._jax_masters(), *self.inner_optimizer.variables]

    def _jax_masters(self) -> list:
        return list(self._masters.values()) if keras.backend.backend() == "jax" else []

    # ------------------------------------------------------------------ state
    def _state(self) -> DeviceLossScale:
        return DeviceLossScale(self.dynamic_scale.value, self.step_counter.value, self._hysteresis.value,
                               self._skipped.value, self._steps.value)

    def loss_scale_state(self) -> LossScaleState:
        return to_state(self._state())  # a mirrored variable: its primary copy

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        problems = LossScale(self.spec).problems(state)  # the rule as it runs here (a float32 scale)
        if problems:
            raise StateError("loss-scale state: " + "; ".join(problems))
        self.dynamic_scale.assign(held(state.scale))
        for var, value in zip((self.step_counter, self._hysteresis, self._skipped, self._steps),
                              (state.growth_tracker, state.hysteresis_left, state.skipped, state.steps), strict=True):
            var.assign(np.asarray(value, COUNTER))

    # ------------------------------------------------------------------ Keras hooks
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: list) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build([self._masters.get(id(v), v) for v in var_list])
        keras.optimizers.Optimizer.build(self, var_list)

    def scale_loss(self, loss: Any) -> Any:
        if self.spec.mode == "none":
            return loss
        return loss * ops.cast(self.dynamic_scale, loss.dtype)

    def check_finite(self, grads: list) -> Any:
        return all_finite(grads)

    def _checking(self) -> bool:
        return self.spec.mode != "none" or self.spec.skip_nonfinite

    def _apply_inner(self, grads: list, trainable_variables: list | None, sync_masters: bool = True) -> None:
        tvs = list(trainable_variables or self._trainable_variables)
        scale = None if self.spec.mode == "none" else self.dynamic_scale
        if not self._masters:
            self.inner_optimizer.apply(_unscale(grads, scale, tvs), trainable_variables=tvs)
            return
        grads32 = [g if g is None else _dense32(g) for g in grads]
        targets = [self._masters.get(id(v), v) for v in tvs]
        self.inner_optimizer.apply(_unscale(grads32, scale, tvs), trainable_variables=targets)
        if sync_masters:
            for v, m in zip(tvs, targets, strict=True):
                if m is not v:
                    v.assign(ops.cast(m, v.dtype))

    def _update(self, finite: Any) -> None:
        new = next_state(self.spec, self._state(), finite)
        if self.spec.mode == "dynamic":
            self.dynamic_scale.assign(new.scale)
            self.step_counter.assign(new.growth_tracker)
            self._hysteresis.assign(new.hysteresis_left)
        if self.spec.skip_nonfinite:
            self._skipped.assign(new.skipped)
        self._steps.assign(new.steps)

    def _finish(self, finite: Any) -> None:
        """The state after a step: the rule's update on ``finite``, or (None: nothing checked) one more step."""
        if finite is None:
            self._count(self._steps)
        else:
            self._update(finite)

    def _common_apply(self, grads: list, trainable_variables: list | None = None) -> None:
        grads = list(grads)
        finite = self.check_finite(grads) if self._checking() else None
        if self.spec.skip_nonfinite:
            _cond(finite, lambda: self._apply_inner(grads, trainable_variables))
        else:
            self._apply_inner(grads, trainable_variables)
        self._finish(finite)

    # ------------------------------------------------------------------ JAX: inside jit
    def _stateless_apply(self, optimizer_variables: list, grads: list, trainable_variables: list) -> tuple[list, list]:
        """One step as pure values: ``(new trainable values, new optimizer values)`` in :attr:`variables`' order; a
        skipped step returns the old values (a select), the loss-scale state follows the rule."""
        if not self.built:
            raise ValueError("unimp AmpOptimizer.stateless_apply: build it first "
                             "(optimizer.build(model.trainable_variables))")

        own, masters = list(self._variables), self._jax_masters()
        if len(masters) != len(self._masters):
            raise NotImplementedError("unimp AmpOptimizer.stateless_apply with float32 master weights runs on "
                                      "Keras' JAX backend; on TensorFlow and torch call optimizer.apply(grads, vars)")
        n_own, n_m = len(own), len(masters)
        values = list(optimizer_variables)
        own_v, master_v, inner_v = values[:n_own], values[n_own:n_own + n_m], values[n_own + n_m:]
        tvs = list(self._trainable_variables)
        grads, trainable_variables = list(grads), list(trainable_variables)
        with keras.StatelessScope(state_mapping=list(zip(self.variables, values))) as scope:
            finite = self.check_finite(grads) if self._checking() else None
            scale = None if self.spec.mode == "none" else self.dynamic_scale.value
            slot = {id(m): i for i, m in enumerate(masters)}
            where = [slot.get(id(self._masters[id(v)])) if id(v) in self._masters else None for v in tvs]
            targets = [master_v[w] if w is not None else t for w, t in zip(where, trainable_variables, strict=True)]
            gs = [g if g is None or w is None else ops.cast(g, "float32") for g, w in zip(grads, where, strict=True)]
            new_targets, new_inner = self.inner_optimizer.stateless_apply(inner_v, _unscale(gs, scale, tvs),
                                                                          targets)
            self._finish(finite)
        new_own = [scope.get_current_value(v) for v in own]
        new_own = [o if n is None else n for o, n in zip(own_v, new_own, strict=True)]
        new_masters = list(master_v)
        for w, t in zip(where, new_targets, strict=True):
            if w is not None:
                new_masters[w] = t
        new_tvs = [t if w is None else ops.cast(t, v.dtype) for w, t, v in zip(where, new_targets, tvs, strict=True)]
        if self.spec.skip_nonfinite:
            keep = lambda new, old: [ops.where(finite, a, b) for a, b in zip(new, old, strict=True)]
            new_tvs = keep(new_tvs, trainable_variables)
            new_masters = keep(new_masters, master_v)
            new_inner = keep(new_inner, inner_v)
        return new_tvs, [*new_own, *new_masters, *new_inner]

    # ------------------------------------------------------------------ tf.distribute
    def _tf_apply(self, grads: list, trainable_variables: list | None = None) -> None:
        from .tf_distribute import tf_apply

        tf_apply(self, grads, trainable_variables)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["loss_scale"] = {k: list(v) if isinstance(v, tuple) else v  # resolved: initial is a number
                                for k, v in asdict(self.spec).items() if k != "initial_auto"}
        config["reduce_dtype"] = self.reduce_dtype
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> AmpOptimizer:
        inner = serialization_lib.deserialize_keras_object(config["inner_optimizer"],
                                                           custom_objects=custom_objects)
        ls = dict(config["loss_scale"])
        ls["hysteresis_refill"] = tuple(ls["hysteresis_refill"])
        return cls(inner, LossScaleSpec(**ls), name=config.get("name"),
                   reduce_dtype=config.get("reduce_dtype", "float32"))


class KerasAmpOptimizer(SavesAsKeras):
    """Keras' own ``LossScaleOptimizer`` rule, plus the canonical skip/step counters."""

    def __init__(self, inner_optimizer: Any, spec: LossScaleSpec, name: str | None = None) -> None:
        spec = spec.starting_at(initial_scale(), "Keras")
        super().__init__(inner_optimizer, spec, spec.initial, name or "keras_loss_scale")
        self._pending: LossScaleState | None = None
        self._make_counters()
        self._make_exact_state()

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: list) -> None:
        super().build(var_list)
        if self._pending is not None:
            self.dynamic_scale.assign(self._pending.scale)
            self.step_counter.assign(self._pending.growth_tracker)
            self._pending = None

    def loss_scale_state(self) -> LossScaleState:
        if self.built:
            scale, tracker = float(self.dynamic_scale.value), int(self.step_counter.value)
        else:
            st = self._pending or LossScale(self.spec).initial_state()
            scale, tracker = st.scale, st.growth_tracker
        return LossScaleState(scale, tracker, 1, int(self._skipped.value), int(self._steps.value))

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        if state.hysteresis_left != 1:
            raise StateError(f"Keras' LossScaleOptimizer has no hysteresis; got hysteresis_left="
                             f"{state.hysteresis_left} (expected 1)")
        if state.growth_tracker >= self.spec.growth_interval:  # keras LossScaleOptimizer grows at == steps - 1
            raise StateError(f"growth_tracker: {state.growth_tracker} is not below loss_scale.growth_interval "
                             f"({self.spec.growth_interval}): Keras' LossScaleOptimizer grows only when its "
                             f"step_counter equals growth_interval - 1, so it would never grow from there where "
                             f"the rule grows on the next finite step; apply with native_loss_scale=False")
        self._skipped.assign(state.skipped)
        self._steps.assign(state.steps)
        if self.built:
            self.dynamic_scale.assign(state.scale)
            self.step_counter.assign(state.growth_tracker)
        else:
            self._pending = state

    def scale_loss(self, loss: Any) -> Any:
        if not self.built and self._pending is not None:
            return loss * ops.cast(self._pending.scale, loss.dtype)
        return super().scale_loss(loss)

    def _stateless_apply(self, optimizer_variables: list, grads: list, trainable_variables: list) -> tuple[list, list]:
        """Keras' own stateless step (JAX), plus the step / skip counters."""
        finite = self.check_finite(grads)
        new_tvs, new_vars = super()._stateless_apply(optimizer_variables, grads, trainable_variables)
        at = {id(v): i for i, v in enumerate(self.variables)}
        new_vars = list(new_vars)
        i, j = at[id(self._steps)], at[id(self._skipped)]
        room = lambda c: ops.cast(c < dtypes.INT32_MAX, COUNTER)  # saturate, never wrap
        steps, skipped = optimizer_variables[i], optimizer_variables[j]
        new_vars[i] = steps + room(steps)
        new_vars[j] = skipped + room(skipped) * ops.cast(ops.logical_not(finite), COUNTER)
        return new_tvs, new_vars

    def _common_apply(self, grads: list, trainable_variables: list | None = None) -> None:
        self._count(self._steps)
        super()._common_apply(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self) -> None:
        self._count(self._skipped)
        super()._stateful_handle_non_finite_grads()

