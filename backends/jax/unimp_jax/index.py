"""The model index the Plan is compiled from: per Flax layer its path, kind, class names and tiling dims.

A layer is a Flax module whose class maps to a canonical op (``Linear``/``Dense`` -> linear, ``Conv``,
``Embed``, norms, attention, RNN cells, ``Einsum``) or an :class:`unimp_jax.Op` wrapping a JAX function
(its class and function names). An nnx Module is walked; a linen Module creates its submodules only
while calling, so its index is what one abstract forward of an example batch meets.

>>> from flax import nnx
>>> [(i.path, i.kind, i.dims) for i in model_index(nnx.Linear(16, 12, rngs=nnx.Rngs(0)))]
[('', 'linear', (('in_features', 16), ('out_features', 12)))]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from unimp.spi import LayerInfo, ops

from .layers import is_nnx
from .ops import NATIVE_OPS

EXTRA_KINDS = {"Einsum": "matmul", "MultiHeadDotProductAttention": "attention", "SelfAttention": "attention",
               "SimpleCell": "rnn", "MGUCell": "rnn", "ConvLSTMCell": "rnn"}
DIM_PARAMS = ("kernel", "embedding")
ALIGNED_KINDS = ("linear", "matmul", "conv", "embedding")


def layer_kind(type_name: str, op_kind: str | None = None) -> str | None:
    """Canonical op of a Flax module class name (``op_kind`` for :class:`unimp_jax.Op`)."""
    return op_kind or ops.kind_of(type_name, NATIVE_OPS) or EXTRA_KINDS.get(type_name)


def dims(kind: str, params: Mapping[str, Any]) -> tuple[tuple[str, int], ...]:
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


def layer_info(path: str, type_name: str, params: Any, op_kind: str | None = None,
               fn_name: str | None = None) -> LayerInfo | None:
    """One layer as a :class:`LayerInfo` (None: not a layer); ``params()`` gives its own params."""
    kind = layer_kind(type_name, op_kind)
    if kind is None:
        return None
    return LayerInfo(path, kind, (type_name, *((fn_name,) if fn_name else ())), dims(kind, params()))


def nnx_info(parts: tuple, m: Any) -> LayerInfo | None:
    cls = getattr(type(m), "_unimp_original", type(m))  # a layer unimp wraps keeps its class's name
    return layer_info(".".join(map(str, parts)), cls.__name__,
                      lambda: {k: v.get_value() for k, v in vars(m).items() if isinstance(v, nnx.Param)},
                      op_kind=getattr(m, "kind", None) if cls.__name__ == "Op" else None,
                      fn_name=getattr(m, "fn_name", None))


def own_params(m: Any) -> dict[str, Any]:
    """A bound linen module's own param arrays (not its submodules')."""
    params = m.variables.get("params", {}) if m.scope is not None else {}
    return {k: v for k, v in params.items() if not isinstance(v, Mapping)}


def linen_info(m: Any) -> LayerInfo | None:
    is_op = type(m).__name__ == "LinenOp"
    return layer_info(".".join(map(str, m.path)), type(m).__name__, lambda: own_params(m),
                      op_kind=m.op_kind if is_op else None, fn_name=m.fn_name() if is_op else None)


def model_index(model: Any, variables: Any = None, inputs: tuple = ()) -> tuple[LayerInfo, ...]:
    """The layers of an nnx Module, or of a linen Module called on ``inputs`` with ``variables``."""
    if is_nnx(model):
        return tuple(i for parts, m in nnx.iter_modules(model) if (i := nnx_info(parts, m)))
    found: dict[str, LayerInfo] = {}

    def discover(next_fun: Any, args: Any, kwargs: Any, ctx: Any) -> Any:
        if ctx.method_name == "__call__" and (info := linen_info(ctx.module)) and info.path not in found:
            found[info.path] = info
        return next_fun(*args, **kwargs)

    def forward(v: Any) -> Any:
        with nn.intercept_methods(discover):
            return model.apply(v, *inputs)

    jax.eval_shape(forward, variables)
    return tuple(found.values())
