"""tf.distribute (Keras' TensorFlow backend only): gradient all-reduce in the Plan's ``reduce_dtype``, XLA refusal.

Keras sums gradients in their own dtype (no hook) and its ``LossScaleOptimizer`` takes replica 0's finiteness, so
unimp's wrapper reduces in ``reduce_dtype`` itself (the inner optimizer's all-reduce is then the identity) and
agrees on finiteness in one ``merge_call``: all replicas step or skip together, the state updated once.

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
    ms, os_ = (s if is_distributed(s) else None for s in (getattr(model, "_distribute_strategy", None),
                                                           getattr(optimizer, "_distribution_strategy", None)))
    if optimizer is not None and ms is not os_:
        where = ("the model under a tf.distribute strategy's scope but not the optimizer" if ms is not None
                 else "the optimizer under a tf.distribute strategy's scope but not the model" if os_ is not None
                 else "the model and optimizer under different strategies")
        raise ValueError(f"unimp (keras): {where}; Keras needs both created inside the same "
                         "strategy.scope() (its optimizer variables must be mirrored like the model's). fix: "
                         "with strategy.scope(): model = ...; optimizer = keras.optimizers.Adam(...); "
                         "then unimp.apply(policy, model, optimizer)")
    return ms or os_


def all_reduce(ctx: Any, grads: list, reduce_dtype: str, out_dtypes: list) -> list:
    """Sum ``grads`` over replicas in ``reduce_dtype``; ``out_dtypes[i]`` is grad i's dtype after (``None`` stays
    ``None``; ``IndexedSlices`` are densified, as Keras' own TF all-reduce does)."""
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
    """:data:`XLA_MESSAGE` inside an XLA-compiled (``jit_compile=True``) function."""
    from tensorflow.python.ops import control_flow_util

    if not tf.executing_eagerly() and control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise UnsupportedError(XLA_MESSAGE)


def tf_apply(opt: Any, grads: list, trainable_variables: list | None = None) -> None:
    """``AmpOptimizer.apply`` on TensorFlow: its own step, or under a strategy :func:`distributed_apply`."""
    if tf.distribute.in_cross_replica_context():
        raise ValueError("unimp AmpOptimizer.apply() must be called in a replica context "
                         "(inside strategy.run(...)), as Keras optimizers require")
    if not tf.distribute.has_strategy():
        opt._common_apply(grads, trainable_variables)
        return
    distributed_apply(opt, list(grads), trainable_variables)


def distributed_apply(opt: Any, grads: list, trainable_variables: list | None) -> None:
    """Replica context: reduce in ``reduce_dtype``, vote on finiteness, step or skip together."""
    refuse_xla()
    tvs = list(trainable_variables or opt._trainable_variables)
    ctx = tf.distribute.get_replica_context()
    out = [tf.float32 if id(v) in opt._masters else g.dtype if g is not None else None
           for g, v in zip(grads, tvs, strict=True)]
    reduced = all_reduce(ctx, grads, opt.reduce_dtype, out)
    finite = opt.check_finite(reduced) if opt._checking() else tf.constant(True)
    ctx.merge_call(_cross_replica_step, args=(opt, reduced, finite, tvs))


def _cross_replica_step(distribution: Any, opt: Any, reduced: list, finite: Any, tvs: list) -> None:
    # Every replica's flag (identical after the sum, since inf/nan propagate through it) is
    # combined explicitly: one decision, taken once, for all replicas.
    agreed = tf.reduce_all(tf.stack([tf.convert_to_tensor(f) for f in
                                     distribution.experimental_local_results(finite)]))

    def step() -> None:
        distribution.extended.call_for_each_replica(opt._apply_inner, args=(reduced, tvs),
                                                    kwargs={"sync_masters": False})
        for v in tvs:
            m = opt._masters.get(id(v))
            if m is not None:
                distribution.extended.update(v.value, _assign_cast, args=(m.value,), group=False)

    if opt.spec.skip_nonfinite:
        tf.cond(agreed, step, lambda: None)
    else:
        step()
    opt._finish(agreed if opt._checking() else None)


def _assign_cast(var: Any, master: Any) -> Any:
    return var.assign(tf.cast(master, var.dtype))
