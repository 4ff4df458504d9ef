"""Observe one real eager forward: per layer (units, and subclassed containers) the dtype it computed in (the
widest float input after Keras' casting; for a layer with ``autocast = False``: the dtype it produces), its
variables' and its output's.

>>> import keras, numpy as np
>>> from unimp_keras.index import walk
>>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="fc")])
>>> seen, out = observe(m, walk(m), np.zeros((1, 3), "float32"))
>>> seen["fc"], out
(('float32', 'float32', 'float32'), 'float32')
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras

from unimp.spi import dtypes

from .index import Unit, is_graph

Seen = tuple[str | None, str | None, str | None]  # compute, param, output


def _float_dtypes(structure: Any) -> list[str]:
    out = []
    for t in keras.tree.flatten(structure):
        dtype = getattr(t, "dtype", None)
        if dtype is not None and (keras.ops.is_tensor(t) or keras.backend.is_keras_tensor(t)):
            name = keras.backend.standardize_dtype(dtype)
            if keras.backend.is_float_dtype(name):
                out.append(name)
    return out


def call_name(layer: Any) -> str:
    """The method Keras runs for ``layer``: ``quantized_call`` for a quantized layer (float8), else ``call``."""
    return "quantized_call" if getattr(layer, "quantization_mode", None) else "call"


def set_method(obj: Any, name: str, fn: Any, undo: list[tuple[Any, Any, str]]) -> None:
    """``fn`` as ``obj``'s own ``name``; ``(obj, its own one before or None, name)`` appended to ``undo``."""
    undo.append((obj, obj.__dict__.get(name), name))
    object.__setattr__(obj, name, fn)


def restore(obj: Any, own: Any, name: str) -> None:
    """``obj``'s own ``name`` put back to ``own`` (None: it had none)."""
    if own is None:
        obj.__dict__.pop(name, None)
    else:
        object.__setattr__(obj, name, own)


def param_dtype(layer: Any) -> str | None:
    """The dtype the layer's float variables are stored in (None without variables)."""
    dtypes = [keras.backend.standardize_dtype(w.dtype) for w in layer.weights]
    dtypes = [d for d in dtypes if keras.backend.is_float_dtype(d)]
    return dtypes[0] if dtypes else None


def observe(model: Any, units: Iterable[Unit], x: Any) -> tuple[dict[str, Seen], str | None]:
    """``({path: (compute, param, output)}, model output dtype)`` from one eager forward on ``x``."""
    seen: dict[str, Seen] = {}
    produced: dict[str, str | None] = {}  # a layer's own result dtype, before unimp's cast to its block's
    patched: list[tuple[Any, Any, str]] = []
    inners = []
    for u in units:
        if u.container and is_graph(u.layer):  # a Sequential/functional model only joins its layers
            continue
        layer = u.layer
        name = call_name(layer)
        original = getattr(layer, name)
        inner = getattr(original, "inner", None)
        if inner is not None:  # results cast to the enclosing block's dtype (binding.patch_stream)

            def inner_recorder(*args: Any, _p: str = u.path, _inner: Any = inner, **kwargs: Any) -> Any:
                out = _inner(*args, **kwargs)
                outs = _float_dtypes(out)
                produced.setdefault(_p, outs[0] if outs else None)
                return out

            original.inner = inner_recorder
            inners.append((original, inner))

        def recorder(*args: Any, _u: Unit = u, _orig: Any = original, **kwargs: Any) -> Any:
            out = _orig(*args, **kwargs)
            ins, outs = _float_dtypes((args, kwargs)), _float_dtypes(out)
            output = outs[0] if outs else None
            compute = dtypes.widest(ins) if ins and _u.layer.autocast else produced.get(_u.path, output)
            seen.setdefault(_u.path, (compute, None, output))
            return out

        set_method(layer, name, recorder, patched)
    try:
        out = model(x, training=False)
    finally:
        for call, inner in inners:
            call.inner = inner
        for layer, own, name in reversed(patched):
            restore(layer, own, name)
    params = {u.path: param_dtype(u.layer) for u in units}  # outside any autocast scope
    seen = {p: (c, params[p], o) for p, (c, _, o) in seen.items()}
    outs = _float_dtypes(out)
    return seen, (outs[0] if outs else None)
