"""Dtype names used everywhere in unimp (plain strings, never framework objects).

>>> widest(["bfloat16", "float32"])
'float32'
"""

from __future__ import annotations

from collections.abc import Iterable

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
COMPUTE_DTYPES = (*FLOAT_DTYPES, "auto")
LOW_PRECISION = ("float16", "bfloat16")

_RANK = {"float16": 1, "bfloat16": 1, "float32": 2, "float64": 3}


def is_low(dtype: str | None) -> bool:
    """True for float16/bfloat16."""
    return dtype in LOW_PRECISION


def widest(dtypes: Iterable[str | None]) -> str | None:
    """The dtype promotion picks among float inputs (float16 + bfloat16 -> float32)."""
    seen = [d for d in dtypes if d in _RANK]
    if not seen:
        return None
    top = max(_RANK[d] for d in seen)
    tops = {d for d in seen if _RANK[d] == top}
    if len(tops) > 1:  # float16 with bfloat16
        return "float32"
    return tops.pop()
