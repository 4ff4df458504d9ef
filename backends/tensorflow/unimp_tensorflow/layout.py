"""Layout findings: dims that are not a multiple of ``layout.align``, and conv data formats.

>>> import keras
>>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(12, name="fc")])
>>> from unimp_tensorflow.index import walk
>>> misaligned(walk(m), 8)
['fc: input_dim=4 is not a multiple of 8', 'fc: units=12 is not a multiple of 8']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .index import Unit


def _dims(layer: Any) -> list[tuple[str, int]]:
    """The dims of a layer that matter for tensor-core tiling, with Keras' names."""
    if hasattr(layer, "embeddings") and getattr(layer, "input_dim", None) is not None:
        return [("input_dim", int(layer.input_dim)), ("output_dim", int(layer.output_dim))]
    kernel = getattr(layer, "kernel", None) if getattr(layer, "built", False) else None
    if kernel is None or len(kernel.shape) < 2:
        return []
    out_name = "filters" if hasattr(layer, "filters") else "units"
    return [("input_dim" if out_name == "units" else "input_channels", int(kernel.shape[-2])),
            (out_name, int(kernel.shape[-1]))]


def misaligned(units: Iterable[Unit], align: int) -> list[str]:
    """One finding per dim not a multiple of ``align``: ``"fc1: units=32 is not a multiple of 64"``."""
    if align <= 1:
        return []
    out = []
    for u in units:
        if u.container:
            continue
        for name, n in _dims(u.layer):
            if n % align:
                out.append(f"{u.path}: {name}={n} is not a multiple of {align}")
    return out


def data_formats(units: Iterable[Unit]) -> dict[str, str]:
    """``data_format`` of every layer that has one (convolutions, pooling), by path."""
    return {u.path: u.layer.data_format for u in units
            if isinstance(getattr(u.layer, "data_format", None), str)}


def layout_findings(formats: dict[str, str], channels_last: bool) -> list[str]:
    """Layers whose data format differs from the policy's ``channels_last`` (existing models are not
    rewritten: their input layout would change)."""
    if not channels_last:
        return []
    return [f"{path}: data_format='{fmt}', the policy asks channels_last; rebuild this layer with "
            f"data_format='channels_last' (or build the model under unimp_tensorflow.scope(policy))"
            for path, fmt in formats.items() if fmt != "channels_last"]
