"""``Op`` / ``LinenOp``: a JAX function as a Flax layer, so the policy controls its dtype.

JAX functions called bare (``jax.nn.log_softmax(x)``) run in their inputs' dtype; wrapped in an
``Op`` they are layers of canonical kind ``kind`` (default: from the function's name via the core's
flax names: relu/gelu/... -> activation, softmax, log_softmax, exp/log -> transcendental, ...).

>>> import jax, jax.numpy as jnp
>>> op = Op(jax.nn.log_softmax)
>>> op.kind, op(jnp.zeros((1, 2))).shape
('log_softmax', (1, 2))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
from flax import nnx

from unimp.spi import ops

from .ops import NATIVE_OPS


def _kind(fn: Callable[..., Any], kind: str | None) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    kind = kind or ops.kind_of(name, NATIVE_OPS)
    if kind not in ops.CANONICAL_OPS:
        raise ValueError(f"Op({name}): kind={kind!r} is not a canonical op; fix: pass kind= one of "
                         f"{', '.join(ops.CANONICAL_OPS)}")
    return kind


class Op(nnx.Module):
    """nnx layer applying ``fn`` (``dtype``: set by unimp during the call; None = inputs' dtype)."""

    def __init__(self, fn: Callable[..., Any], kind: str | None = None) -> None:
        self.fn = fn
        self.kind = _kind(fn, kind)
        self.fn_name = getattr(fn, "__name__", type(fn).__name__)
        self.dtype = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class LinenOp(nn.Module):
    """linen layer applying ``fn``: ``LinenOp(jax.nn.relu)`` (``kind`` as for :class:`Op`)."""

    fn: Callable[..., Any]
    kind: str | None = None
    dtype: Any = None

    @property
    def op_kind(self) -> str:
        return _kind(self.fn, self.kind)

    @nn.nowrap
    def fn_name(self) -> str:
        return getattr(self.fn, "__name__", type(self.fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)
