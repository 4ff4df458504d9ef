"""``paddle.DataParallel`` under one unimp policy: order, gradient all-reduce dtype, agreed skips.

Paddle requires ``paddle.amp.decorate`` (which ``unimp.apply`` performs) *before* ``paddle.DataParallel``, so
the order is ``amp = unimp.apply(policy, layer, optimizer)``, then ``model = amp.data_parallel()``;
``unimp.apply`` on a ``paddle.DataParallel`` is refused with that fix (:func:`refuse_data_parallel`).
``amp.data_parallel()`` adds:

- **Agreed non-finite decision.** ``amp.optimizer.step()`` all-reduces the found-inf flag (max) over the group
  before the loss-scale rule runs, so every rank skips the same step (:func:`agree_found_inf`).
- **Gradient all-reduce in ``distributed.reduce_dtype``.** When every gradient already has that dtype, Paddle's
  own reducer does it. Otherwise Paddle's reducer is switched off (``grad_need_sync = False``) and
  ``amp.optimizer.step()`` reduces all gradients in one flat buffer cast to ``reduce_dtype`` (averaged, like
  Paddle's reducer), then casts back (:func:`reduce_grads`).
- **float16 on CPU** (gloo): ``all_reduce`` of a float16 tensor returns inf for any input, so
  ``reduce_dtype = "float16"`` on a CPU place is an ``UnsupportedError`` (``on_unsupported = "error"``) or
  reduced in float32 with a ``fallback:`` note in ``amp.plan.notes``. bfloat16 and float32 are exact.

>>> import paddle, unimp
>>> amp = unimp.apply({"extends": "fp32"}, paddle.nn.Linear(4, 4))
>>> flag = paddle.to_tensor([True])
>>> bool(agree_found_inf(flag, None))     # world size 1: no collective, the local flag
True
>>> amp.remove() is not None
True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from unimp.spi import UnsupportedError, dtypes

from .plan import model_place

FIX = ("fix: apply unimp to the plain layer first, then wrap it: amp = unimp.apply(policy, layer, "
       "optimizer); model = amp.data_parallel()")
GLOO_FP16 = ("Paddle's CPU collective (gloo, paddlepaddle 3.3) returns inf for every float16 "
             "all_reduce (measured: 1.5 + 1.5 -> inf)")


def refuse_data_parallel(model: Any) -> None:
    """A clear error for ``unimp.apply`` on a ``paddle.DataParallel`` (the wrong order)."""
    import paddle

    if isinstance(model, paddle.DataParallel):
        raise ValueError("unimp.apply: got a paddle.DataParallel; Paddle requires AMP decoration "
                         "(paddle.amp.decorate, which unimp.apply performs) before DataParallel, so "
                         f"the policy must be applied to the inner layer. {FIX}")


def world_size(group: Any) -> int:
    """Ranks in ``group`` (the default group when None); 1 when no parallel env is initialised."""
    import paddle.distributed as dist

    if group is not None:
        return int(group.nranks)
    return int(dist.get_world_size()) if dist.is_initialized() else 1


def agree_found_inf(found_inf: Any, group: Any, nranks: int | None = None) -> Any:
    """The found-inf flag all ranks agree on: all_reduce(max) of the local flags (bool tensor [1]).

    At world size 1 the local flag is returned as is (no collective).
    """
    import paddle.distributed as dist

    n = world_size(group) if nranks is None else nranks
    if n <= 1:
        return found_inf
    flag = found_inf.astype("int32")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.astype("bool")


def reduce_grads(dtype: str, group: Any, nranks: int, params: tuple[Any, ...]) -> None:
    """Average the gradients of ``params`` across ``group`` in ``dtype``: one flat buffer, one all_reduce."""
    import paddle
    import paddle.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if nranks <= 1 or not grads:
        return
    with paddle.no_grad():
        flat = paddle.concat([g.astype(dtype).reshape([-1]) for g in grads])
        flat = flat * paddle.to_tensor(1.0 / nranks, dtype=dtype)  # mean, as Paddle's reducer
        dist.all_reduce(flat, group=group)
        parts = paddle.split(flat, [int(g.size) for g in grads])
        for g, part in zip(grads, parts, strict=True):
            g.set_value(part.reshape(g.shape).astype(g.dtype))


def data_parallel(amp: Any, **kwargs: Any) -> Any:
    """Wrap ``amp``'s layer in ``paddle.DataParallel(**kwargs)`` under the policy (see module doc)."""
    import paddle

    if getattr(amp, "_dp", None) is not None:
        raise RuntimeError("amp.data_parallel(): this Amp's layer is already wrapped; use amp.model")
    if amp._removed:
        raise RuntimeError("amp.data_parallel(): this Amp was removed; apply the policy again first")
    layer = amp.model
    reduce = amp.plan.reduce_dtype
    if reduce == "float16" and model_place(layer) == "cpu":
        what = f"distributed.reduce_dtype = 'float16': {GLOO_FP16}"
        if amp.plan.on_unsupported == "error":
            raise UnsupportedError(
                f"{amp.plan.where} cannot be honoured by backend paddle:\n  "
                f"{what}\nfix: set distributed.reduce_dtype = \"bfloat16\" or \"float32\", use a CUDA "
                "place (NCCL), or on_unsupported = \"fallback\" to reduce in float32 as reported")
        reduce = "float32"
        amp.plan = dataclasses.replace(amp.plan, notes=(
            *amp.plan.notes, f"fallback: {what}; gradients are all-reduced in float32"))
    dp = paddle.DataParallel(layer, **kwargs)
    group = kwargs.get("group")
    nranks = world_size(group)
    params = tuple(p for o in amp.optimizers for p in o._params) if amp.optimizers else tuple(
        p for p in layer.parameters() if not p.stop_gradient)
    # no optimizer: nobody calls step(), so Paddle's reducer must do it (in the grads' dtype)
    native = {dtypes.dtype_name(p.dtype) for p in params} <= {reduce} or amp.optimizer is None
    if not native:
        dp.grad_need_sync = False  # Paddle's reducer off; amp.optimizer.step() reduces in `reduce`
    amp.native["data_parallel"] = {
        "nranks": nranks, "reduce_dtype": reduce,
        "all_reduce": "paddle reducer" if native else "unimp (amp.optimizer.step, flat buffer)",
        "found_inf": "all_reduce max over the group"}
    for opt in amp.optimizers:  # each reduces (and agrees found-inf over) its own parameters
        opt.distribute(group, nranks, None if native else functools.partial(reduce_grads, reduce, group, nranks))
    amp._dp = dp
    amp._layer = layer
    amp.model = dp
    return dp
