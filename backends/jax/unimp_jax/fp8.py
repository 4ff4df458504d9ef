"""FP8 dots for the layers the Plan chooses: scaled e4m3 (forward) / e5m2 or e4m3 (gradient) ``dot_general``s.

A layer the Plan runs in FP8 gets, for its call, a ``dot_general`` that quantizes the activation and
the kernel to the forward format, multiplies the FP8 operands with ``lax.dot_general`` (XLA lowers
that to a cuBLASLt FP8 GEMM on Hopper; XLA:CPU emulates it) and dequantizes with the product of the
scales; the backward pass quantizes the output gradient to the gradient format the same way.

Recipes:

- ``delayed``: scales from an amax history (Transformer Engine's rule, the one Flax's ``fp8_ops`` and
  Keras implement). The state per layer is Flax's: ``input_scale``, ``kernel_scale``,
  ``output_grad_scale`` (shape ``(1,)``) and the three ``*_amax_history`` (shape ``(amax_history,)``).
  As in Flax, the new state leaves the step as the *gradient* of the state ("overwrite with
  gradient"): ``amp.value_and_grad`` returns it untouched by the loss scale, the unimp optimizer
  writes it back on applied steps. nnx keeps it in ``nnx.Variable``s of type :class:`Fp8State` on the
  layer (attribute ``unimp_fp8``); linen in the ``_overwrite_with_gradient`` collection of
  ``amp.params`` (Flax's own collection name, so ``flax.training.TrainState`` handles it too). In a
  data-parallel step each amax is max-reduced over the data axis before the history update, so every
  replica keeps the same state.
- current scaling (:data:`CURRENT`, no state; torchao's ``Float8LinearConfig.from_recipe_name``
  recipes): ``tensorwise``, one scale per tensor from this step's amax; ``rowwise``, one scale per
  row of each GEMM operand (amax over that GEMM's contracted dims: activation and output gradient per
  row, weight per output column in the forward), power-of-2 scales; ``rowwise_gw_hp``, rowwise for
  the output and grad-input GEMMs (the weight per tensor there) and the grad-weight GEMM
  ``x^T . dy`` in the compute dtype.

>>> import jax.numpy as jnp
>>> dot = dot_general_for("tensorwise", "float8_e4m3fn", "float8_e5m2")
>>> y = dot(jnp.ones((2, 16), jnp.bfloat16), jnp.ones((16, 16), jnp.bfloat16), (((1,), (0,)), ((), ())))
>>> y.dtype, float(y[0, 0])
(dtype(bfloat16), 16.0)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from .layers import is_float

OWG = fp8_ops.OVERWRITE_WITH_GRADIENT  # '_overwrite_with_gradient': Flax's collection for this state
NNX_ATTR = "unimp_fp8"
SCALES = ("input_scale", "kernel_scale", "output_grad_scale")
HISTORIES = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history")
STATE_NAMES = SCALES + HISTORIES


class Fp8State(nnx.Variable):
    """An nnx Variable holding delayed-scaling state (a scale or an amax history) of one FP8 layer."""


class Fp8Meta(nnx.Module):
    """The six delayed-scaling Variables of one nnx layer, attached as ``layer.unimp_fp8``."""

    def __init__(self, amax_history: int) -> None:
        for name, value in init_state(amax_history).items():
            setattr(self, name, Fp8State(value))

    def values(self) -> dict[str, Any]:
        return {name: getattr(self, name)[...] for name in STATE_NAMES}


def init_state(amax_history: int) -> dict[str, Any]:
    """Fresh delayed-scaling state: scales 1, histories 0 (float32, Flax's shapes), one buffer each
    (a donated step must not meet one buffer twice)."""
    return {**{n: jnp.ones((1,), jnp.float32) for n in SCALES},
            **{n: jnp.zeros((amax_history,), jnp.float32) for n in HISTORIES}}


def is_state_path(path: Any) -> bool:
    """Whether a pytree key path leads to FP8 state (nnx ``unimp_fp8`` or the linen collection)."""
    for k in path:
        name = getattr(k, "key", getattr(k, "name", k))
        if name in (OWG, NNX_ATTR):
            return True
    return False


def map_gradients(fn: Any, grads: Any) -> Any:
    """``fn`` over the floating gradient leaves that are not FP8 state (those pass through)."""
    def one(path: Any, g: Any) -> Any:
        return g if is_state_path(path) or not is_float(g) else fn(g)

    return jax.tree_util.tree_map_with_path(one, grads)


def without_state(tree: Any) -> Any:
    """``tree`` with the FP8 state leaves dropped (for finiteness checks): a list of leaves."""
    return [x for p, x in jax.tree_util.tree_leaves_with_path(tree) if not is_state_path(p)]


# ---------------------------------------------------------------------- the dots
@dataclasses.dataclass(frozen=True)
class Current:
    """A current-scaling recipe (scales from this step's amax), torchao's ``Float8LinearConfig`` terms.

    ``rows``: one scale per row of each GEMM operand (amax over that GEMM's contracted dims: the
    activation per row, the weight per output column in the forward), else one per tensor;
    ``pow2``: scales rounded to powers of 2 (torchao's ``round_scales_to_power_of_2``);
    ``weight_rows_for_grad_input``: the weight of the grad-input GEMM per row too (else tensorwise);
    ``grad_weight_hp``: the grad-weight GEMM (x^T dy) runs in the compute dtype, unquantized.
    """

    rows: bool
    pow2: bool = False
    weight_rows_for_grad_input: bool = False
    grad_weight_hp: bool = False


CURRENT = {  # torchao's Float8LinearConfig.from_recipe_name("tensorwise" | "rowwise" | "rowwise_with_gw_hp")
    "tensorwise": Current(rows=False),
    "rowwise": Current(rows=True, pow2=True, weight_rows_for_grad_input=True),
    "rowwise_gw_hp": Current(rows=True, grad_weight_hp=True),
}
RECIPES = ("delayed", *CURRENT)  # what this backend runs (declared in backend.fp8_support)


# The products of per-row scales are dot_generals of float32 arrays whose contracted dims have size 1:
# computed exactly (a GPU's or TPU's default float32 dot may round its operands to TF32 or bfloat16).
EXACT = jax.lax.Precision.HIGHEST


def _scale(x: Any, q_dtype: Any, axes: tuple[int, ...] | None, pow2: bool = False) -> Any:
    """Current scaling: ``amax / fp8_max`` over ``axes``, kept as size-1 dims, or over the whole tensor
    (``axes=None``: a scalar); x / scale fills the format. 1 where the amax is zero. A non-finite amax
    stays non-finite, as in torchao: an inf scale turns the operand's inf into nan and a nan stays nan,
    so an overflow reaches the loss-scale check instead of being clipped to the FP8 max. ``pow2``:
    torchao's rule, the multiplier ``fp8_max / amax`` rounded down to a power of 2.

    Written as a hand-written recipe writes it (one compare, one scalar per tensor): XLA's GPU compiler
    then rewrites each FP8 dot and its scales into one cuBLASLt FP8 GEMM, as for the native recipe."""
    amax = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None).astype(jnp.float32)
    fmax = jnp.float32(jnp.finfo(q_dtype).max)
    nonzero = amax > 0  # False for a nan amax too: its scale is 1 and the nan passes through
    safe = jnp.where(nonzero, amax, fmax)
    s = 1.0 / jnp.exp2(jnp.floor(jnp.log2(fmax / safe))) if pow2 else safe / fmax
    return jnp.where(nonzero, s, jnp.float32(1.0))


def _quantize(x: Any, q_dtype: Any, axes: tuple[int, ...] | None, pow2: bool = False) -> tuple[Any, Any]:
    """``(x in q_dtype, its scale)``: scaled by :func:`_scale` over ``axes``, clipped to the format."""
    s = _scale(x, q_dtype, axes, pow2)
    return fp8_ops.quantize(x, q_dtype, s, x.dtype), s


def _dequant(y: Any, dtype: Any, *scales: Any) -> Any:
    s = scales[0]
    for t in scales[1:]:
        s = s * t
    return fp8_ops.dequantize(y, dtype, s)


def _dims(dn: Any, x_ndim: int, w_ndim: int) -> tuple[tuple[int, ...], ...]:
    """``(x contracted, w contracted, x kept, w kept, g's dims from x, g's dims from w)`` of ``dn``."""
    (xc, wc), (xb, wb) = dn
    x_kept = tuple(i for i in range(x_ndim) if i not in xc and i not in xb)
    w_kept = tuple(i for i in range(w_ndim) if i not in wc and i not in wb)
    nb = len(xb)
    return (tuple(xc), tuple(wc), x_kept, w_kept, tuple(range(nb, nb + len(x_kept))),
            tuple(range(nb + len(x_kept), nb + len(x_kept) + len(w_kept))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _current(x: Any, w: Any, dn: Any, fwd: Any, grad: Any, how: Current) -> Any:
    return _current_fwd(x, w, dn, fwd, grad, how)[0]


def _current_fwd(x: Any, w: Any, dn: Any, fwd: Any, grad: Any, how: Current) -> tuple[Any, Any]:
    """Each GEMM operand quantized with scales over that GEMM's contracted dims (or the whole tensor).
    The product of two operands' per-row scales is their ``dot_general`` (the contracted dims have size
    1: an outer product); per-tensor scales are scalars and multiply, as a hand-written recipe writes
    ``sx * sw`` (no degenerate dot left for the compiler to lower)."""
    cdt = x.dtype
    xc, wc, _, _, _, _ = _dims(dn, x.ndim, w.ndim)
    qx, sx = _quantize(x, fwd, xc if how.rows else None, how.pow2)
    qw, sw = _quantize(w, fwd, wc if how.rows else None, how.pow2)
    y = jax.lax.dot_general(qx, qw, dn, preferred_element_type=cdt)
    scale = jax.lax.dot_general(sx, sw, dn, precision=EXACT) if how.rows else sx * sw
    return _dequant(y, cdt, scale), (x, w, qx, sx, qw, sw)


def _current_bwd(dn: Any, fwd: Any, grad: Any, how: Current, res: Any, g: Any) -> tuple[Any, Any]:
    x, w, qx, sx, qw, sw = res  # per tensor (not rows), the forward's operands serve the backward too
    cdt = x.dtype
    _, _, x_kept, w_kept, g_x, g_w = _dims(dn, x.ndim, w.ndim)
    rows = how.rows
    # grad input = g . w^T: contracted over w's kept dims (g's dims that came from w)
    qg, sg = _quantize(g, grad, g_w if rows else None, how.pow2)
    if rows:
        qw, sw = _quantize(w, fwd, w_kept if how.weight_rows_for_grad_input else None, how.pow2)
    if rows and not how.weight_rows_for_grad_input:  # one weight scale against per-row ones: keep batch dims
        sw = jnp.broadcast_to(sw, tuple(n if i in dn[1][1] else 1 for i, n in enumerate(w.shape)))
    kw = dict(dimension_numbers=dn, precision=None, preferred_element_type=cdt)
    scale_kw = {**kw, "preferred_element_type": None, "precision": EXACT}
    gx = fp8_ops.dot_general_transpose_lhs(qg, x, qw, **kw)
    gx = _dequant(gx, cdt, fp8_ops.dot_general_transpose_lhs(sg, x, sw, **scale_kw) if rows else sg * sw)
    # grad weight = x^T . g: contracted over x's kept dims (g's dims that came from x)
    if how.grad_weight_hp:
        gw = fp8_ops.dot_general_transpose_rhs(g.astype(cdt), x, w, **kw)
    else:
        qg2, sg2 = (qg, sg) if not rows else _quantize(g, grad, g_x, how.pow2)
        if rows:
            qx, sx = _quantize(x, fwd, x_kept, how.pow2)
        gw = fp8_ops.dot_general_transpose_rhs(qg2, qx, w, **kw)
        gw = _dequant(gw, cdt, fp8_ops.dot_general_transpose_rhs(sg2, sx, w, **scale_kw) if rows else sg2 * sx)
    return gx.astype(x.dtype), gw.astype(w.dtype)


_current.defvjp(_current_fwd, _current_bwd)

def _update_meta(x: Any, q_dtype: Any, scale: Any, history: Any, axis: Any) -> tuple[Any, Any]:
    """Flax's delayed-scaling update (``fp8_ops.update_fp8_meta``) with ``x``'s amax; inside a
    data-parallel step (``axis``: the mesh axis name) the amax is first agreed across the axis (max,
    Transformer Engine's amax reduction), so every replica records the same history and scale."""
    if axis is None:
        return fp8_ops.update_fp8_meta(x, q_dtype, scale, history)
    from .distributed import max_over

    amax = max_over(jnp.max(jnp.abs(x)).astype(history.dtype), axis)
    return fp8_ops.update_fp8_meta(amax, q_dtype, scale, history)  # max|amax| = amax: Flax's rule on it


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _delayed(x: Any, w: Any, sx: Any, sw: Any, sg: Any, hx: Any, hw: Any, hg: Any,
             dn: Any, fwd: Any, grad: Any, axis: Any) -> Any:
    return _delayed_fwd(x, w, sx, sw, sg, hx, hw, hg, dn, fwd, grad, axis)[0]


def _delayed_fwd(x: Any, w: Any, sx: Any, sw: Any, sg: Any, hx: Any, hw: Any, hg: Any,
                 dn: Any, fwd: Any, grad: Any, axis: Any) -> tuple[Any, Any]:
    cdt = x.dtype
    nsx, nhx = _update_meta(x, fwd, sx, hx, axis)
    nsw, nhw = _update_meta(w, fwd, sw, hw, axis)
    qx, qw = fp8_ops.quantize(x, fwd, nsx, cdt), fp8_ops.quantize(w, fwd, nsw, cdt)
    y = jax.lax.dot_general(qx, qw, dn, preferred_element_type=cdt)
    return _dequant(y, cdt, nsx, nsw), (x, w, qx, qw, nsx, nsw, nhx, nhw, sg, hg)


def _delayed_bwd(dn: Any, fwd: Any, grad: Any, axis: Any, res: Any, g: Any) -> tuple[Any, ...]:
    x, w, qx, qw, nsx, nsw, nhx, nhw, sg, hg = res
    cdt = x.dtype
    nsg, nhg = _update_meta(g, grad, sg, hg, axis)
    qg = fp8_ops.quantize(g, grad, nsg, cdt)
    gx = fp8_ops.dot_general_transpose_lhs(qg, x, qw, dimension_numbers=dn, precision=None,
                                           preferred_element_type=cdt)
    gw = fp8_ops.dot_general_transpose_rhs(qg, qx, w, dimension_numbers=dn, precision=None,
                                           preferred_element_type=cdt)
    # the state's "gradients" are its new values (Flax's overwrite-with-gradient convention)
    return (_dequant(gx, cdt, nsw, nsg).astype(x.dtype), _dequant(gw, cdt, nsx, nsg).astype(w.dtype),
            nsx, nsw, nsg, nhx, nhw, nhg)


_delayed.defvjp(_delayed_fwd, _delayed_bwd)

_AMAX_AXIS: contextvars.ContextVar[Any] = contextvars.ContextVar("unimp_fp8_amax_axis", default=None)


@contextlib.contextmanager
def amax_agreed_over(axis_name: Any) -> Iterator[None]:
    """While tracing a data-parallel step: delayed-scaling amaxes are max-reduced over ``axis_name``.

    ``amp.value_and_grad(loss_fn, axis_name=...)`` wraps its differentiation in this; a custom
    sharded step can too.
    """
    token = _AMAX_AXIS.set(axis_name)
    try:
        yield
    finally:
        _AMAX_AXIS.reset(token)


def dot_general_for(recipe: str, forward: str, gradient: str, state: Mapping[str, Any] | None = None) -> Any:
    """A ``dot_general`` running ``recipe`` (``forward``/``gradient``: jnp FP8 dtype names).

    ``state`` (delayed only): the layer's six state arrays (see :func:`init_state`).
    """
    fwd, grad = jnp.dtype(forward), jnp.dtype(gradient)

    def dot(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
            preferred_element_type: Any = None, **_: Any) -> Any:
        rhs = rhs.astype(lhs.dtype)
        dn = jax.tree_util.tree_map(int, dimension_numbers)
        dn = tuple(tuple(tuple(a) for a in pair) for pair in dn)
        if recipe in CURRENT:
            out = _current(lhs, rhs, dn, fwd, grad, CURRENT[recipe])
        else:
            s = state
            assert s is not None  # a delayed recipe carries its scales and amax histories
            out = _delayed(lhs, rhs, s["input_scale"], s["kernel_scale"], s["output_grad_scale"],
                           s["input_amax_history"], s["kernel_amax_history"], s["output_grad_amax_history"],
                           dn, fwd, grad, _AMAX_AXIS.get())
        return out if preferred_element_type is None else out.astype(preferred_element_type)

    return dot


# ---------------------------------------------------------------------- the Plan's side
def layer_plan(plan: Any, lp: Any, dims: tuple[tuple[str, int], ...], decisions: list) -> Any:
    """``lp`` (a :class:`~unimp_jax.layers.LayerPlan`) with the recipe and formats when the Plan runs the
    layer in FP8 (``dims``: its tiling dims from the index); when FP8 was asked of it, its
    :class:`~unimp.spi.Fp8Decision` is appended to ``decisions`` (the report's FP8 lines)."""
    from unimp.spi import Fp8Decision, dtypes

    if not plan.asks_fp8(lp.path, lp.kind, lp.type_names):
        return lp
    gemm = dict(dims) if dims and dims[0][0] == "in_features" else None  # a 2-D kernel's (in, out)
    if gemm is None and lp.kind == "linear":
        decision = Fp8Decision(lp.path, False, None, "no 2-D kernel (a LinearGeneral/Einsum split): stays in "
                                                     "the compute dtype")
    else:
        decision = plan.decide_fp8(lp.path, lp.kind, lp.type_names, gemm)
    decisions.append(decision)
    if not decision.fp8:
        return lp
    names = (dtypes.FP8_FORMATS[plan.fp8.forward_format], dtypes.FP8_FORMATS[plan.fp8.gradient_format])
    return dataclasses.replace(lp, fp8=decision.recipe, fp8_formats=names)


# ---------------------------------------------------------------------- nnx state
def nnx_write_state(model: Any, grads: Any, applied: Any) -> None:
    """Write the new delayed-scaling state (``grads``' Fp8State leaves) into ``model`` when ``applied``."""
    new = nnx.as_pure(nnx.state(grads, Fp8State))
    if not jax.tree_util.tree_leaves(new):
        return
    old = nnx.as_pure(nnx.state(model, Fp8State))
    nnx.update(model, jax.tree_util.tree_map(lambda n, o: jnp.where(applied, n, o), new, old))


# ---------------------------------------------------------------------- linen state
def split(params: Any) -> tuple[Any, Any]:
    """``(params, fp8 state or None)`` of a linen params tree (a variables dict with the FP8 collection)."""
    if isinstance(params, Mapping) and OWG in params:
        return params["params"], params[OWG]
    return params, None


def linen_state(paths: Any, amax_history: int) -> dict[str, Any]:
    """Fresh delayed-scaling state for the linen layers at ``paths`` (nested by module path)."""
    tree: dict[str, Any] = {}
    for path in paths:
        node = tree
        for part in path.split("."):
            node = node.setdefault(part, {})
        node.update(init_state(amax_history))
    return tree


def lookup(tree: Any, path: str) -> Any:
    """The state dict at module ``path`` in a nested state tree."""
    for part in path.split("."):
        tree = tree[part]
    return tree


# ---------------------------------------------------------------------- state_dict
def to_plain(tree: Any) -> dict[str, list[float]]:
    """The state as ``{"layer.path.name": [floats]}`` (float32 values, exact as Python floats)."""
    import numpy as np

    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        keys = [k for k in keys if k not in (NNX_ATTR, OWG, "value")]
        out[".".join(keys)] = [float(v) for v in np.asarray(x, np.float32).ravel()]
    return out


def from_plain(tree: Any, plain: Mapping[str, Any]) -> Any:
    """``tree`` with the values of ``plain`` (what :func:`to_plain` made, checked by
    :meth:`unimp.spi.Amp.fp8_state_problems`)."""
    import numpy as np

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(np.asarray(plain[key], np.float32).reshape(x.shape))
                                                  for x, key in zip(leaves, to_plain(tree), strict=True)])
