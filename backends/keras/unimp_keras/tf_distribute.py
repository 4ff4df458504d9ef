"""tf.distribute support: gradient all-reduce in the Plan's ``reduce_dtype``, XLA refusal.

Keras 3 on TensorFlow sums gradients across replicas inside the optimizer
(``TFOptimizer._all_reduce_sum_gradients``, called from ``_backend_update_step``) in the
gradients' own dtype, with no hook for the reduction dtype, and Keras' ``LossScaleOptimizer``
decides finiteness from replica 0's *local* gradients (a non-finite gradient on another replica
is applied and poisons every replica). unimp's optimizer wrapper therefore does the reduction
itself, in the replica context: each replica casts its (scaled) gradients to ``reduce_dtype``,
they are summed with ``ReplicaContext.all_reduce`` and cast back; finiteness is checked on the
reduced gradients and the replicas' flags are combined (logical AND) in one ``merge_call``, so
every replica skips or steps together and the loss-scale update runs once, in the cross-replica
context, on mirrored variables. The inner optimizer's own all-reduce is turned into the identity
while it is wrapped (it receives gradients that are already reduced).

>>> import tensorflow as tf
>>> is_distributed(tf.distribute.get_strategy())
False
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unimp.spi import UnsupportedError

XLA_MESSAGE = (
    "unimp (keras): the optimizer step of a tf.distribute strategy that uses merge_call "
    "(MirroredStrategy here) cannot be compiled by XLA (jit_compile=True): the cross-replica "
    "gradient all-reduce and the agreed skip decision need merge_call / per-device variables, which an "
    "XLA cluster cannot hold (Keras' own optimizers and LossScaleOptimizer fail the same way: "
    "keras-team/keras#21366, #17187). fix: model.compile(..., jit_compile=False) (Keras' default "
    "'auto' already turns XLA off under tf.distribute), or a tf.function without jit_compile around "
    "strategy.run(...)")


def is_distributed(strategy: Any) -> bool:
    """Whether ``strategy`` is a real ``tf.distribute`` strategy (not the default one)."""
    from tensorflow.python.distribute import distribute_lib

    return strategy is not None and strategy is not distribute_lib._get_default_strategy()


def strategy_of(model: Any, optimizer: Any) -> Any:
    """The strategy ``model`` / ``optimizer`` were created under; a clear error if they disagree."""
    ms = getattr(model, "_distribute_strategy", None)
    os_ = getattr(optimizer, "_distribution_strategy", None) if optimizer is not None else None
    ms = ms if is_distributed(ms) else None
    os_ = os_ if is_distributed(os_) else None
    if optimizer is not None and ms is not os_:
        where = ("the model under a tf.distribute strategy's scope but not the optimizer" if ms is not None
                 else "the optimizer under a tf.distribute strategy's scope but not the model"
                 if ms is None and os_ is not None else "the model and optimizer under different strategies")
        raise ValueError(f"unimp (keras): {where}; Keras needs both created inside the same "
                         "strategy.scope() (its optimizer variables must be mirrored like the model's). fix: "
                         "with strategy.scope(): model = ...; optimizer = keras.optimizers.Adam(...); "
                         "then unimp.apply(policy, model, optimizer)")
    return ms or os_


def in_xla_context() -> bool:
    """Whether the code being traced is inside an XLA-compiled (``jit_compile=True``) function."""
    from tensorflow.python.ops import control_flow_util

    return (not tf.executing_eagerly()
            and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def all_reduce(ctx: Any, grads: list, reduce_dtype: str, out_dtypes: list) -> list:
    """Sum ``grads`` over replicas in ``reduce_dtype``; ``out_dtypes[i]`` is grad i's dtype after.

    ``None`` gradients stay ``None``; ``IndexedSlices`` are densified (as Keras' own TF
    all-reduce does for a non-sparse reduction).
    """
    idx = [i for i, g in enumerate(grads) if g is not None]
    if not idx:
        return list(grads)
    sent = []
    for i in idx:
        g = tf.convert_to_tensor(grads[i])
        sent.append(g if g.dtype == reduce_dtype else tf.cast(g, reduce_dtype))
    summed = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sent)
    out = list(grads)
    for i, s in zip(idx, summed, strict=True):
        out[i] = s if s.dtype == out_dtypes[i] else tf.cast(s, out_dtypes[i])
    return out


def identity_all_reduce(grads_and_vars: Any) -> list:
    """Installed as the wrapped inner optimizer's ``_all_reduce_sum_gradients``: already reduced."""
    return list(grads_and_vars)


def hook_inner(inner: Any) -> None:
    """Make ``inner``'s own cross-replica sum the identity (unimp's wrapper has reduced already)."""
    object.__setattr__(inner, "_all_reduce_sum_gradients", identity_all_reduce)


def unhook_inner(inner: Any) -> None:
    if inner.__dict__.get("_all_reduce_sum_gradients") is identity_all_reduce:
        del inner.__dict__["_all_reduce_sum_gradients"]


def refuse_xla() -> None:
    if in_xla_context():
        raise UnsupportedError(XLA_MESSAGE)
