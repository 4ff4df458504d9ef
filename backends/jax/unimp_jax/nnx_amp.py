"""Flax nnx: the policy set on the user's Module in place (reversibly) + an nnx Optimizer.

Each layer instance gets a subclass of its own class whose ``__call__`` runs the layer under its
:class:`~unimp_jax.layers.LayerPlan` (static, so ``nnx.jit`` caches by it); params are cast to the
policy's param dtypes (fp32 masters go to the optimizer first). ``remove()`` puts back classes,
attributes and params (the trained values, or the originals bit for bit if never trained).

>>> import jax, optax, unimp
>>> from flax import nnx
>>> model = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
>>> amp = unimp.apply("fp32", model, optax.sgd(0.1))
>>> loss_fn = lambda m, x: m(x).mean()
>>> @nnx.jit
... def step(model, optimizer, x):
...     loss, grads, finite = amp.value_and_grad(loss_fn)(optimizer, model, x)
...     optimizer.update(model, grads)
...     return loss
>>> float(step(amp.model, amp.optimizer, jax.numpy.ones((2, 4)))) != 0.0
True
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
from flax import nnx

from unimp.spi import LossScaleState, Plan, Report

from . import fp8, trace
from .amp import JaxAmp
from .index import model_index
from .layers import SCAN_CARRY, LayerPlan, cast_floats, dtype_name, run_layer, scan_carry_error
from .optimizer import AmpOptimizer, find_state


def _params(module: Any) -> dict[str, Any]:
    """The module's own ``nnx.Param`` Variables (not its submodules')."""
    return {k: v for k, v in vars(module).items() if isinstance(v, nnx.Param)}


@functools.cache
def _wrapped_class(cls: type) -> type:
    """``cls`` with a ``__call__`` that applies the instance's layer plan and output dtype."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        lp: LayerPlan | None = self.__dict__.get("_unimp_layer")
        out_dtype, token = self.__dict__.get("_unimp_output", (None, None))
        if token is not None:
            trace.remember_inputs(token, args, kwargs)
        call = functools.partial(cls.__call__, self)
        if lp is None and token is not None:  # the model itself: jax.lax.scan's carry check, located
            try:
                out = call(*args, **kwargs)
            except TypeError as e:
                if SCAN_CARRY not in str(e):
                    raise
                raise scan_carry_error(e) from None
        elif lp is None:
            out = call(*args, **kwargs)
        else:
            dot = None
            if lp.fp8:
                meta = self.__dict__.get(fp8.NNX_ATTR)
                dot = fp8.dot_general_for(lp.fp8, lp.fp8_formats[0], lp.fp8_formats[1],
                                          meta.values() if meta is not None else None)
            param_dtype = next((dtype_name(v.get_value()) for v in _params(self).values()), None)
            out = run_layer(lp, self, call, args, kwargs, param_dtype, dot)
        return cast_floats(out, out_dtype) if out_dtype else out

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "_unimp_original": cls})


class NnxAmp(JaxAmp):
    """The policy bound to an nnx Module: ``amp.model`` (same object), ``amp.optimizer`` (nnx)."""

    def __init__(self, plan: Plan, model: Any, tx: Any, wrt: Any = nnx.Param) -> None:
        index = {i.path: i for i in model_index(model)}
        super().__init__(plan if plan.layers else plan.with_index(index.values()), model, tx)
        plan = self.plan  # its layout findings acted on: on_misaligned="error" left the model untouched
        # static under nnx.jit, so equal for equal (model class, policy): compiled steps are reused
        self._token = f"{type(model).__module__}.{type(model).__qualname__}:{plan.fingerprint}"
        self._saved: list[tuple[Any, dict[str, Any]]] = []  # (module, attrs to restore)
        self._params: list[tuple[Any, Any, tuple]] = []  # (Variable, original value, path)
        self._fp8_layers: list[Any] = []  # modules given delayed-scaling state (removed by remove())
        self.optimizer = AmpOptimizer(model, self.tx, wrt=wrt)  # masters from the original params
        for parts, m in list(nnx.iter_modules(model)):
            path = ".".join(map(str, parts))
            lp = self._layer(index[path]) if path in index else None
            if lp and lp.fp8 == "delayed":  # set as nnx data (a plain setattr), so transforms carry it
                assert plan.fp8 is not None  # the layer chose the delayed recipe
                setattr(m, fp8.NNX_ATTR, fp8.Fp8Meta(plan.fp8.amax_history))
                self._fp8_layers.append(m)
            param_dtype = (lp.decision.param_dtype if lp else plan.decide(path, None).param_dtype)
            self._cast_params(parts, m, param_dtype)
            attrs: dict[str, Any] = {"_unimp_layer": lp} if lp else {}
            if not parts:
                attrs["_unimp_output"] = (plan.output_cast, self._token)  # None: "unchanged", not cast
            if lp and "param_dtype" in vars(m):
                attrs["param_dtype"] = jnp.dtype(param_dtype)
            if attrs:
                self._swap(m, attrs)

    def _cast_params(self, parts: tuple, m: Any, dtype: str) -> None:
        for name, v in _params(m).items():
            if dtype_name(v.get_value()) and dtype_name(v.get_value()) != dtype:
                self._params.append((v, v.get_value(), (*parts, name)))
                v.set_value(v.get_value().astype(dtype))

    def _swap(self, m: Any, attrs: dict[str, Any]) -> None:
        saved = {k: vars(m)[k] for k in attrs if k in vars(m)}
        self._saved.append((m, {"__class__": type(m), **saved, "_new": tuple(attrs)}))
        for k, v in attrs.items():
            object.__setattr__(m, k, v)
        # not an nnx attribute; functools.cache's stub wants Hashable, which mypy does not see a class object as
        object.__setattr__(m, "__class__", _wrapped_class(type(m)))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ Amp API
    def _opt_state_holder(self) -> Any:
        return self.optimizer

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        new = self._with_loss_scale(nnx.as_pure(self.optimizer.opt_state), state)
        nnx.update(self.optimizer.opt_state, nnx.state(new))

    def report(self, *args: Any, **kwargs: Any) -> Report:
        """What ran, from a traced forward (``args``: example inputs; default: the last call's shapes)."""
        if not args and not kwargs:
            last = trace.last_inputs(self._token)
            if last is None:
                raise self.no_forward()
            args, kwargs = last
        return trace.report(self, lambda: nnx.eval_shape(lambda m, a, k: m(*a, **k), self.model, args, kwargs))

    def fp8_state(self) -> Any:
        """The delayed-scaling state of the FP8 layers (an nnx State of :class:`~unimp_jax.fp8.Fp8State`)."""
        return nnx.as_pure(nnx.state(self.model, fp8.Fp8State))

    def set_fp8_state(self, tree: Any) -> None:
        nnx.update(self.model, tree)

    def masters(self) -> Any:
        """The fp32 master params (an nnx State), or None when the policy keeps none."""
        return find_state(self.optimizer).master

    def _restore(self) -> None:
        trained = self.masters()
        masters = {tuple(k): v for k, v in nnx.to_flat_state(trained)} if trained is not None else {}
        for var, original, path in self._params:
            current = var.get_value()
            if bool(jnp.array_equal(current, original.astype(current.dtype))):
                var.set_value(original)  # never trained: the original bits
                continue
            master = masters.get(path)
            source = current if master is None else getattr(master, "value", master)
            var.set_value(jnp.asarray(source).astype(original.dtype))
        for m, saved in reversed(self._saved):
            object.__setattr__(m, "__class__", saved["__class__"])
            for k in saved["_new"]:
                if k in saved:
                    object.__setattr__(m, k, saved[k])
                else:
                    vars(m).pop(k, None)
        for m in self._fp8_layers:
            delattr(m, fp8.NNX_ATTR)
        self._saved, self._params, self._fp8_layers = [], [], []

