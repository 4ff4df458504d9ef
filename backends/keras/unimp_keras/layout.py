"""Layout findings about conv data formats (dims not a multiple of ``layout.align`` are the Plan's, from
the model index: :func:`unimp_keras.index.dims`).

>>> data_formats([])
{}
"""

from __future__ import annotations

from collections.abc import Iterable

from .index import Unit


def data_formats(units: Iterable[Unit]) -> dict[str, str]:
    """``data_format`` of every layer that has one (convolutions, pooling), by path."""
    return {u.path: u.layer.data_format for u in units
            if isinstance(getattr(u.layer, "data_format", None), str)}


def layout_findings(formats: dict[str, str], channels_last: bool) -> list[str]:
    """Layers whose data format differs from the Plan's ``channels_last`` (an existing model is not rewritten)."""
    if not channels_last:
        return []
    return [f"{path}: data_format='{fmt}', the policy asks channels_last; rebuild this layer with "
            f"data_format='channels_last' (or build the model under unimp_keras.scope(policy))"
            for path, fmt in formats.items() if fmt != "channels_last"]
