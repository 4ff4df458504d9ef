"""The cast around one Flax layer call under its Plan row (shared by nnx and linen).

During a layer's call its ``dtype`` attribute is the decided compute dtype and its floating inputs
and outputs are cast to it; params keep their stored dtype (Flax casts them to ``dtype`` inside the
layer, so gradients reach the fp32 params).

>>> import unimp
>>> from unimp.spi import LayerInfo
>>> plan = unimp.get_backend("jax").compile(unimp.load("mixed_bf16"))
>>> d = LayerPlan.of(plan, LayerInfo("fc1", "linear", ("Linear",)))
>>> d.kind, d.decision.compute_dtype
('linear', 'bfloat16')
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from unimp.spi import LayerInfo, Plan, UnsupportedError, dtypes

from . import trace
from .attention import attention, needs_cpu_attention

SCAN_CARRY = "scan body function carry input and carry output must have equal types"


@dataclass(frozen=True)
class LayerPlan:
    """What the policy asks of one layer (hashable: it is static under jit)."""

    path: str
    kind: str | None
    type_names: tuple[str, ...]
    decision: Any  # the Plan's LayerDecision
    softmax_fp32: bool = False  # linen attention: force_fp32_for_softmax
    fp8: str | None = None  # the FP8 recipe the Plan chose for this layer (unimp_jax.fp8), None = not FP8
    fp8_formats: tuple[str, ...] = ()  # (forward, gradient) FP8 dtype names when fp8 is set

    @classmethod
    def of(cls, plan: Plan, info: LayerInfo) -> LayerPlan:
        """The Plan's decision for the indexed layer ``info``."""
        softmax_fp32 = info.kind == "attention" and plan.op("softmax").requested == "float32"
        return cls(info.path, info.kind, info.type_names, plan.decide(info.path, info.kind, info.type_names),
                   softmax_fp32)

    def compute_dtype(self, input_dtype: str | None, param_dtype: str | None) -> str | None:
        """The dtype this call runs in, given the activation input's and the params' dtypes."""
        d = self.decision
        if d.compute_dtype is not None:
            return d.compute_dtype
        if d.category == "promote" and d.override is None:
            return dtypes.widest([input_dtype, param_dtype])
        return input_dtype or param_dtype


def dtype_name(x: Any) -> str | None:
    import jax.numpy as jnp

    dt = getattr(x, "dtype", None)
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        return None
    return jnp.dtype(dt).name


def is_float(x: Any) -> bool:
    """Whether ``x`` is a floating array (what a policy casts)."""
    return dtype_name(x) is not None


def cast_float(x: Any, dtype: str) -> Any:
    """``x`` as ``dtype`` when it is a floating array of another dtype, else ``x``."""
    name = dtype_name(x)
    return x.astype(dtype) if name and name != dtype else x


def first_float_dtype(tree: Any) -> str | None:
    import jax

    for leaf in jax.tree_util.tree_leaves(tree):
        name = dtype_name(leaf)
        if name:
            return name
    return None


def cast_floats(tree: Any, dtype: str | None) -> Any:
    """Every floating array leaf of ``tree`` as ``dtype`` (others untouched)."""
    import jax
    import jax.numpy as jnp

    if dtype is None:
        return tree
    return jax.tree_util.tree_map(lambda x: cast_float(x, dtype), tree, is_leaf=lambda x: isinstance(x, jnp.ndarray))


@contextlib.contextmanager
def attrs_set(obj: Any, **values: Any) -> Iterator[None]:
    """Temporarily set attributes (bypassing frozen dataclasses / nnx checks); restored after."""
    saved = {k: obj.__dict__[k] for k in values if k in obj.__dict__}
    try:
        for k, v in values.items():
            object.__setattr__(obj, k, v)
        yield
    finally:
        for k in values:
            if k in saved:
                object.__setattr__(obj, k, saved[k])
            else:
                obj.__dict__.pop(k, None)


def run_layer(lp: LayerPlan, module: Any, call: Any, args: tuple, kwargs: dict, param_dtype: str | None,
              dot_general: Any = None) -> Any:
    """Call one layer under its plan: inputs, ``dtype`` attribute and outputs in the compute dtype.

    ``dot_general``: the layer's FP8 dot for this call (:mod:`unimp_jax.fp8`), when the Plan chose FP8.
    """
    watch = sys.modules.get(f"{__package__}.watch")  # not loaded: no watch, and no import (nor jax) per call
    col = watch.collector() if watch is not None else None  # a watched loss is being traced
    if col is not None:
        args, kwargs = col.enter(lp.path, args, kwargs)
    x_dtype = first_float_dtype((args, kwargs))
    dt = lp.compute_dtype(x_dtype, param_dtype)
    # batch_norm in float32 (core semantics, as torch/Keras): fp32 math, output in the activation dtype
    out_dt = x_dtype if lp.kind == "batch_norm" and lp.decision.category == "float32" and x_dtype else dt
    args, kwargs = cast_floats((args, kwargs), dt)
    extra: dict[str, Any] = {}
    if "dtype" in module.__dict__ or hasattr(type(module), "dtype"):
        extra["dtype"] = dt
    if lp.softmax_fp32 and hasattr(module, "force_fp32_for_softmax"):
        extra["force_fp32_for_softmax"] = True
    if lp.kind == "attention" and needs_cpu_attention(module, dt):
        extra["attention_fn"] = attention  # nnx: JAX's fp16 attention algorithm does not lower on XLA:CPU
    if dot_general is not None:
        extra["dot_general"] = dot_general
    with attrs_set(module, **extra):
        out = call(*args, **kwargs)
    out = cast_floats(out, out_dt)
    trace.record(lp, dt, param_dtype, first_float_dtype(out))
    return out if col is None else col.leave(lp.path, (args, kwargs), out, dt)


def scan_carry_error(e: TypeError, scan: str = "nnx.scan") -> UnsupportedError:
    """A located unimp error for ``jax.lax.scan``'s carry check inside an ``nnx.scan`` (or linen
    ``nn.scan``) under a policy."""
    detail = next((line for line in str(e).splitlines() if "carry component" in line), str(e).splitlines()[0])
    api = "nnx" if scan.startswith("nnx") else "linen"
    return UnsupportedError(
        f"unimp (jax/{api}): an {scan} body hands its carry back in another dtype than it came in "
        f"({detail.strip()}): under the policy a layer at the end of the body (typically a float32 "
        f"norm) changes it. Fix: cast the carry back at the end of the body, as a mixed-precision model "
        f"written by hand does (`return y.astype(x.dtype)`), or keep that layer in the carry's dtype "
        f"with an override, e.g. overrides = [{{modules = [\"blocks.norm\"], compute_dtype = \"bfloat16\"}}]")


def is_nnx(model: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def is_linen(model: Any) -> bool:
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(model, linen.Module)
