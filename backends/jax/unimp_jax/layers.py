"""Per-layer decisions and the cast around one Flax layer call (shared by nnx and linen).

A layer is a Flax module whose class maps to a canonical op (``Linear``/``Dense`` -> linear,
``Conv``, ``Embed``, norms, attention, RNN cells, ``Einsum``) or an :class:`unimp_jax.Op`
wrapping a JAX function. During its call the layer's ``dtype`` attribute is the decided compute
dtype and its floating inputs and outputs are cast to it; params keep their stored dtype
(Flax casts them to ``dtype`` inside the layer, so gradients reach the fp32 params).

>>> import unimp
>>> plan = unimp.get_backend("jax").compile(unimp.load("mixed_bf16"))
>>> d = LayerPlan.make(plan, "fc1", "Linear")
>>> d.kind, d.decision.compute_dtype
('linear', 'bfloat16')
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from unimp.spi import LayerDecision, Plan, ReportRow, kind_of, widest

from .attention import attention, needs_cpu_attention
from .ops import NATIVE_OPS

EXTRA_KINDS = {"Einsum": "matmul", "MultiHeadDotProductAttention": "attention", "SelfAttention": "attention",
               "SimpleCell": "rnn", "MGUCell": "rnn", "ConvLSTMCell": "rnn"}
DIM_PARAMS = ("kernel", "embedding")
ALIGNED_KINDS = ("linear", "matmul", "conv", "embedding")


def layer_kind(type_name: str, op_kind: str | None = None) -> str | None:
    """Canonical op of a Flax module class name (``op_kind`` for :class:`unimp_jax.Op`)."""
    if op_kind:
        return op_kind
    return kind_of(type_name, NATIVE_OPS) or EXTRA_KINDS.get(type_name)


@dataclass(frozen=True)
class LayerPlan:
    """What the policy asks of one layer (hashable: it is static under jit)."""

    path: str
    kind: str
    type_names: tuple[str, ...]
    decision: LayerDecision
    softmax_fp32: bool = False  # linen attention: force_fp32_for_softmax
    fp8: str | None = None  # the FP8 recipe the Plan chose for this layer (unimp_jax.fp8), None = not FP8
    fp8_formats: tuple[str, ...] = ()  # (forward, gradient) FP8 dtype names when fp8 is set

    @classmethod
    def make(cls, plan: Plan, path: str, type_name: str, op_kind: str | None = None,
             fn_name: str | None = None) -> LayerPlan | None:
        kind = layer_kind(type_name, op_kind)
        if kind is None:
            return None
        names = (type_name, *((fn_name,) if fn_name else ()))
        decision = plan.decide(path, kind, names)
        softmax_fp32 = kind == "attention" and plan.policy.ops.category("softmax") == "float32"
        return cls(path, kind, names, decision, softmax_fp32)

    def compute_dtype(self, input_dtype: str | None, param_dtype: str | None) -> str | None:
        """The dtype this call runs in, given the activation input's and the params' dtypes."""
        d = self.decision
        if d.compute_dtype is not None:
            return d.compute_dtype
        if d.category == "promote" and d.override is None:
            return widest([input_dtype, param_dtype])
        return input_dtype or param_dtype


def dtype_name(x: Any) -> str | None:
    import jax.numpy as jnp

    dt = getattr(x, "dtype", None)
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        return None
    return jnp.dtype(dt).name


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
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if dtype_name(x) and dtype_name(x) != dtype else x, tree,
        is_leaf=lambda x: isinstance(x, jnp.ndarray))


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
              record: dict[str, ReportRow] | None, dot_general: Any = None) -> Any:
    """Call one layer under its plan: inputs, ``dtype`` attribute and outputs in the compute dtype.

    ``dot_general``: the layer's FP8 dot for this call (:mod:`unimp_jax.fp8`), when the Plan chose FP8.
    """
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
    if record is not None:
        record[lp.path] = ReportRow(lp.path, lp.kind, dt, param_dtype, first_float_dtype(out), fp8=lp.fp8)
    return out


def dims(kind: str, params: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """The tiling dims of a linear/conv/embedding layer from its params (what ``layout.align`` checks)."""
    if kind not in ALIGNED_KINDS:
        return ()
    for name in DIM_PARAMS:
        if name in params:
            shape = tuple(params[name].shape)
            if kind != "conv" and len(shape) != 2:
                return ()  # LinearGeneral/Einsum kernels: the matmul's K/N split is not in the shape
            if name == "embedding":
                return (("num_embeddings", int(shape[-2])), ("features", int(shape[-1])))
            unit = "channels" if kind == "conv" else "features"
            return ((f"in_{unit}", int(shape[-2])), (f"out_{unit}", int(shape[-1])))
    return ()


def is_nnx(model: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def is_linen(model: Any) -> bool:
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(model, linen.Module)
