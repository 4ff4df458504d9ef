"""Data-parallel training under one policy: gradient all-reduce in ``distributed.reduce_dtype``.

Inside ``jax.shard_map`` (or ``jax.pmap``) over a mesh axis, ``amp.value_and_grad(loss_fn,
axis_name="data")`` differentiates each device's *local* loss (the differentiated params are made
device-varying first, so JAX does not insert its own float32 ``psum`` when it transposes the
replication), then:

1. casts the (loss-scaled) local gradients to ``distributed.reduce_dtype``, divides them by the
   axis size in that dtype (as torch's fp16 compression hook does, so fp16 sums stay in range), and
   ``psum``s them over the axis in that dtype — one all-reduce for the whole gradient tree;
2. casts the result back (float32 when a loss scale is on, else each gradient's own dtype) and
   unscales it;
3. agrees on finiteness: the all-finite flag of the reduced gradients (inf/nan of any device propagate
   through the sum) is ``pmin``-reduced over the axis, so every device skips the same step and the
   replicated loss-scale state stays identical;
4. returns the loss averaged over the axis (float32 mean), so it is replicated too.

``amp.data_parallel(step_fn)`` builds the sharded step for you: ``jax.jit`` of a ``shard_map`` over a
1-D mesh with the model/optimizer state replicated (``P()``) and every batch argument split on its
leading axis (``P(axis_name)``); state is donated.

Plain ``jax.jit`` with ``NamedSharding`` inputs (XLA SPMD, no ``shard_map``) cannot honour
``reduce_dtype``: the partitioner inserts the gradient all-reduce where a weight gradient's partial
sums meet, in whatever dtype that op has (measured: the compute dtype, bfloat16, for a bf16 layer's
float32 kernel) — so unimp's distributed path is ``shard_map``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .layers import is_float, is_nnx


def axis_size(axis_name: Any) -> int:
    """Number of devices along ``axis_name`` (inside ``shard_map``/``pmap``)."""
    if hasattr(jax.lax, "axis_size"):
        return int(jax.lax.axis_size(axis_name))
    return int(jax.lax.psum(1, axis_name))


def _varying_axes(x: Any) -> frozenset:
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))


def to_varying(tree: Any, axis_name: Any) -> Any:
    """``tree``'s array leaves typed as varying over ``axis_name`` (values unchanged).

    Under ``shard_map(check_vma=True)`` the gradient w.r.t. a replicated (invariant) value is summed by
    JAX itself, in the gradient's dtype; differentiating a varying copy keeps it local, so unimp can
    reduce it in ``reduce_dtype``. A no-op under ``check_vma=False`` and ``pmap``.
    """
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def one(x: Any) -> Any:
        if not hasattr(x, "dtype"):
            return x
        for ax in axes:
            if ax in _varying_axes(x):
                continue
            if hasattr(jax.lax, "pcast"):
                x = jax.lax.pcast(x, ax, to="varying")
            elif hasattr(jax.lax, "pvary"):
                x = jax.lax.pvary(x, ax)
        return x

    return jax.tree_util.tree_map(one, tree)


def reduce_gradients(grads: Any, axis_name: Any, reduce_dtype: str, out_dtype: str | None = None,
                     skip: Callable[[Any], bool] | None = None) -> Any:
    """The mean of ``grads`` over ``axis_name``, summed in ``reduce_dtype`` (one all-reduce).

    Each floating leaf is cast to ``reduce_dtype``, divided by the axis size there, ``psum``-ed, then cast
    to ``out_dtype`` (default: the leaf's own dtype). Non-floating leaves, and those whose key path
    ``skip(path)`` is true (FP8 scaling state, already agreed), are left alone.
    """

    n = axis_size(axis_name)
    rd = jnp.dtype(reduce_dtype)
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaves = [g for _, g in with_paths]
    idx = [i for i, (p, g) in enumerate(with_paths) if is_float(g) and not (skip is not None and skip(p))]
    low = [leaves[i].astype(rd) for i in idx]
    if n != 1:
        low = [g / jnp.asarray(n, rd) for g in low]
    summed = jax.lax.psum(low, axis_name)
    out = list(leaves)
    for i, g in zip(idx, summed):
        out[i] = g.astype(out_dtype or leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, out)


def agree(flag: Any, axis_name: Any) -> Any:
    """``flag`` ANDed over ``axis_name`` (a ``pmin``): every device gets the same bool."""

    as_int = to_varying(jnp.asarray(flag).astype(jnp.int32), axis_name)
    return jax.lax.pmin(as_int, axis_name) > 0


def max_over(x: Any, axis_name: Any) -> Any:
    """``x``'s maximum over ``axis_name`` (a ``pmax``): every device gets the same value (FP8 amaxes)."""
    return jax.lax.pmax(to_varying(x, axis_name), axis_name)


def mean_over(x: Any, axis_name: Any) -> Any:
    """A floating scalar (the loss) averaged over ``axis_name`` in float32, in its own dtype."""

    if not is_float(x):
        return x
    return jax.lax.pmean(to_varying(x.astype(jnp.float32), axis_name), axis_name).astype(x.dtype)


# ---------------------------------------------------------------------------------------------- step
def _shard_map() -> Any:
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map  # older jax

    def compat(f: Any, *, mesh: Any, in_specs: Any, out_specs: Any, check_vma: bool = True) -> Any:
        return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma)

    return compat


def default_mesh(axis_name: str) -> Any:
    """A 1-D mesh over every device, named ``axis_name``."""
    return jax.make_mesh((jax.device_count(),), (axis_name,))


def data_parallel(amp: Any, step_fn: Callable[..., Any], mesh: Any = None, axis_name: str = "data",
                  donate: bool = True, out_specs: Any = None) -> Callable[..., Any]:
    """``step_fn(state_a, state_b, *batch)`` as a jitted ``shard_map`` step over ``mesh``'s ``axis_name``.

    nnx: ``step_fn(model, optimizer, *batch)`` (mutating, as under ``nnx.jit``); the returned callable
    takes the same arguments, updates ``model`` and ``optimizer`` in place and returns ``step_fn``'s
    output. linen / pure: ``step_fn(params, opt_state, *batch)``; the returned callable is pure.
    The two state arguments are replicated; each batch argument (array or pytree of arrays) is split on
    its leading axis, which must divide by the number of devices on ``axis_name``. ``out_specs``
    (default ``P()``: replicated) describes ``step_fn``'s output; inside ``step_fn`` use
    ``amp.value_and_grad(loss_fn, axis_name=axis_name)`` so gradients are reduced in
    ``reduce_dtype`` and the loss is averaged over the devices.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if mesh is None:
        mesh = default_mesh(axis_name)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"amp.data_parallel: axis_name {axis_name!r} is not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}; fix: pass axis_name=one of those, or a mesh with it")
    n = mesh.shape[axis_name]
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(axis_name))
    out_spec = P() if out_specs is None else out_specs
    shard_map = _shard_map()

    def place_batch(batch: tuple) -> tuple:
        for leaf in jax.tree_util.tree_leaves(batch):
            shape = getattr(leaf, "shape", ())
            if not shape or shape[0] % n:
                raise ValueError(
                    f"amp.data_parallel: a batch argument has shape {tuple(shape)}; every batch leaf needs a "
                    f"leading axis divisible by the {n} devices on {axis_name!r}; fix: pad or trim the batch, "
                    f"or pass per-step constants through a closure")
        return jax.device_put(batch, split)

    if is_nnx(amp.model):
        from flax import nnx

        cache: dict[Any, Any] = {}

        def nnx_step(model: Any, optimizer: Any, *batch: Any) -> Any:
            graphdef, state = nnx.split((model, optimizer))
            key = (graphdef, len(batch))
            if key not in cache:
                def body(state: Any, *batch: Any) -> Any:
                    m, o = nnx.merge(graphdef, state)
                    out = step_fn(m, o, *batch)
                    return nnx.state((m, o)), out

                mapped = shard_map(body, mesh=mesh, in_specs=(P(), *([P(axis_name)] * len(batch))),
                                   out_specs=(P(), out_spec))
                cache[key] = jax.jit(mapped, donate_argnums=(0,) if donate else ())
            new_state, out = cache[key](jax.device_put(state, replicated), *place_batch(batch))
            nnx.update((model, optimizer), new_state)
            return out

        return nnx_step

    cache_pure: dict[int, Any] = {}

    def pure_step(a: Any, b: Any, *batch: Any) -> Any:
        if len(batch) not in cache_pure:
            mapped = shard_map(step_fn, mesh=mesh, in_specs=(P(), P(), *([P(axis_name)] * len(batch))),
                               out_specs=out_spec)
            cache_pure[len(batch)] = jax.jit(mapped, donate_argnums=(0, 1) if donate else ())
        a, b = jax.device_put((a, b), replicated)
        return cache_pure[len(batch)](a, b, *place_batch(batch))

    return pure_step

