"""Flax linen: the policy applied through ``nn.intercept_methods``; params and state stay yours.

``unimp.apply(policy, module, tx, params=params, inputs=x)`` traces one forward (abstractly) to
learn the layer map, casts the params to the policy's param dtypes (``amp.params``) and builds
the optimizer state (``amp.opt_state``, fp32 masters from the params you passed). The module is
never mutated. Everything below is pure and ``jax.jit``-able:

>>> import jax, jax.numpy as jnp, optax, unimp, flax.linen as nn
>>> module = nn.Dense(8)
>>> x = jnp.ones((2, 4))
>>> amp = unimp.apply("fp32", module, optax.sgd(0.1), params=module.init(jax.random.key(0), x)["params"],
...                   inputs=x)
>>> @jax.jit
... def step(params, opt_state, x):
...     loss_fn = lambda p: amp.apply(p, x).mean()
...     loss, grads, finite = amp.value_and_grad(loss_fn)(opt_state, params)
...     updates, opt_state = amp.optimizer.update(grads, opt_state, params)
...     return amp.apply_updates(params, updates, opt_state), opt_state, loss
>>> amp.params, amp.opt_state, loss = step(amp.params, amp.opt_state, x)
>>> amp.skipped_steps
0

``nn.scan`` bodies keep their carry's dtype: a lowered layer may feed the carry (bf16) and a float32
norm hand it back, which ``jax.lax.scan`` refuses; the body's carry is cast back to the dtype it
came in with, as a mixed-precision model written by hand does (:func:`keep_carry`).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from unimp.spi import LossScaleState, Plan, Report

from . import fp8, trace
from .amp import JaxAmp
from .index import linen_info, model_index, own_params
from .layers import SCAN_CARRY, LayerPlan, cast_float, cast_floats, dtype_name, run_layer, scan_carry_error
from .optimizer import find_state


def _as_variables(params: Any) -> dict[str, Any]:
    return dict(params) if isinstance(params, Mapping) and "params" in params else {"params": params}


@functools.cache
def _scan_body_codes() -> frozenset[types.CodeType]:
    """The code of the function ``flax.core.lift.scan`` runs as ``jax.lax.scan``'s body (``scanned``)."""
    from flax.core import lift

    found, todo = set(), [lift.scan.__code__]
    while todo:
        for const in todo.pop().co_consts:
            if isinstance(const, types.CodeType):
                todo.append(const)
                if const.co_name == "scanned":
                    found.add(const)
    return frozenset(found)


def in_scan_body(m: Any, depth: int = 64) -> bool:
    """Whether this call of ``m`` is the body of a linen ``nn.scan`` (a lifted clone run by lift.scan).

    ``depth``: frames searched up to lift.scan's body; a body wrapped in more lifts (``nn.remat``:
    jax.checkpoint's tracing) sits 20+ frames below it."""
    if not m.path or isinstance(m.parent, nn.Module):  # lifted bodies are clones bound to a bare scope
        return False
    codes = _scan_body_codes()
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def keep_carry(args: tuple, out: Any) -> Any:
    """``(carry, ys)`` with the carry's float leaves in the dtypes of the carry that came in (``args[0]``)."""
    if not args or not (isinstance(out, tuple) and len(out) == 2):
        return out
    carry_in, (carry, ys) = args[0], out
    tu = jax.tree_util
    if tu.tree_structure(carry) != tu.tree_structure(carry_in):
        return out

    return tu.tree_map(lambda new, old: cast_float(new, want) if (want := dtype_name(old)) else new,
                       carry, carry_in), ys


class LinenAmp(JaxAmp):
    """The policy bound to a linen Module: ``amp.apply``, ``amp.params``, ``amp.opt_state``."""

    def __init__(self, plan: Plan, module: Any, tx: Any, params: Any, inputs: Any) -> None:
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        variables = _as_variables(params)
        index = model_index(module, variables, inputs)  # one abstract forward: linen makes layers while calling
        super().__init__(plan if plan.layers else plan.with_index(index), module, tx)
        plan = self.plan
        self.optimizer = self.tx
        self.inputs = inputs
        self.original_params = variables["params"]
        for info in index:
            self._layer(info)
        delayed = [path for path, lp in self.layers.items() if lp.fp8 == "delayed"]
        self._fp8_tree: Any = None  # the FP8 state of the forward being traced
        self.params = self.cast_params(self.original_params)
        if delayed:  # Flax's layout: the state in the _overwrite_with_gradient collection next to params
            assert plan.fp8 is not None  # layers chose the delayed recipe
            self.params = {"params": self.params, fp8.OWG: fp8.linen_state(delayed, plan.fp8.amax_history)}
        self.opt_state = self.tx.init(self.original_params)

    def cast_params(self, params: Any) -> Any:
        """``params`` in the policy's param dtype per owning layer (pure_bf16: bf16, norms fp32)."""

        def cast(key_path: Any, x: Any) -> Any:
            path = ".".join(str(getattr(k, "key", k)) for k in key_path[:-1])
            lp = self.layers.get(path)
            dtype = lp.decision.param_dtype if lp else self.plan.decide(path, None).param_dtype
            return cast_float(x, dtype)

        return jax.tree_util.tree_map_with_path(cast, params)

    # ------------------------------------------------------------------ forward
    def apply(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.apply`` under the policy (``params``: the params pytree or a variables dict)."""
        variables = _as_variables(params)
        if fp8.OWG in variables:
            variables = dict(variables)
            self._fp8_tree = variables.pop(fp8.OWG)
        try:
            with nn.intercept_methods(self._intercept):
                out = self.model.apply(variables, *args, **kwargs)
        except TypeError as e:  # jax.lax.scan's carry check (a body unimp did not find): located, with the fix
            if SCAN_CARRY not in str(e):
                raise
            raise scan_carry_error(e, "nn.scan") from None
        finally:
            self._fp8_tree = None
        if kwargs.get("mutable"):  # output_cast None ("unchanged"): as the last layer left it
            return cast_floats(out[0], self.plan.output_cast), out[1]
        return cast_floats(out, self.plan.output_cast)

    def _intercept(self, next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        if ctx.method_name != "__call__":
            return next_fun(*args, **kwargs)
        m = ctx.module
        if in_scan_body(m):
            return keep_carry(args, self._layer_call(next_fun, args, kwargs, m))
        return self._layer_call(next_fun, args, kwargs, m)

    def _layer_call(self, next_fun: Any, args: Any, kwargs: Any, m: Any) -> Any:
        path = ".".join(map(str, m.path))
        lp = self.layers.get(path)
        if lp is None and (info := linen_info(m)) is not None:  # a layer the example forward did not meet
            lp = LayerPlan.of(self.plan, info)
        if lp is None:
            return next_fun(*args, **kwargs)
        own = own_params(m)
        param_dtype = next((dtype_name(v) for v in own.values() if dtype_name(v)), None)
        dot = None
        if lp.fp8:
            state = fp8.lookup(self._fp8_tree, path) if lp.fp8 == "delayed" else None
            dot = fp8.dot_general_for(lp.fp8, lp.fp8_formats[0], lp.fp8_formats[1], state)
        return run_layer(lp, m, next_fun, args, kwargs, param_dtype, dot)

    # ------------------------------------------------------------------ Amp API
    def _opt_state_holder(self) -> Any:
        return self.opt_state

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        self.opt_state = self._with_loss_scale(self.opt_state, state)

    def report(self, *args: Any, params: Any = None) -> Report:
        """What ran in a traced forward of ``args`` (default: the example ``inputs``) with ``params``."""
        return trace.report(self, lambda: jax.eval_shape(lambda p, a: self.apply(p, *a),
                                                         self.params if params is None else params,
                                                         args or self.inputs))

    def fp8_state(self) -> Any:
        """The delayed FP8 scaling state: ``amp.params['_overwrite_with_gradient']`` ({} when none)."""
        return fp8.split(self.params)[1] or {}

    def set_fp8_state(self, tree: Any) -> None:
        self.params = {"params": fp8.split(self.params)[0], fp8.OWG: tree}

    def masters(self) -> Any:
        """The fp32 master params in ``amp.opt_state``, or None when the policy keeps none."""
        return find_state(self.opt_state).master

    def restored_params(self) -> Any:
        """Params to continue without unimp: the masters, else ``amp.params`` in the original dtypes."""
        source = self.masters() if self.masters() is not None else fp8.split(self.params)[0]
        return jax.tree_util.tree_map(lambda s, o: s.astype(o.dtype), source, self.original_params)

    def _restore(self) -> None:
        """Nothing to undo: the module was never mutated and your param pytrees are immutable."""
