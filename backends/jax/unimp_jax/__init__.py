"""unimp-jax: unimp policies for Flax nnx and linen models with optax optimizers.

>>> import unimp_jax
>>> unimp_jax.JaxBackend.name
'jax'

Framework modules load lazily: ``unimp_jax.Op``, ``unimp_jax.LinenOp`` (:mod:`unimp_jax.op_modules`: a
JAX function as a layer), ``unimp_jax.wrap`` (the optax wrapper), ``unimp_jax.apply_updates``,
``unimp_jax.DeviceLossScale``, ``unimp_jax.reduce_gradients`` / ``unimp_jax.data_parallel`` (data
parallel in ``shard_map``).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .backend import JaxBackend

_LAZY = {"Op": "op_modules", "LinenOp": "op_modules", "wrap": "backend", "apply_updates": "optimizer",
         "AmpOptState": "optimizer", "all_finite": "optimizer", "AmpOptimizer": "optimizer",
         "DeviceLossScale": "scaler", "NnxAmp": "nnx_amp", "LinenAmp": "linen_amp",
         "reduce_gradients": "distributed", "data_parallel": "distributed"}

__all__ = ["JaxBackend", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'unimp_jax' has no attribute {name!r}")
