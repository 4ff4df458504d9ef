"""Dtype names used everywhere in unimp (plain strings, never framework objects).

>>> widest(["bfloat16", "float32"])
'float32'
>>> dtype_name("torch.bfloat16"), dtype_name("<dtype: 'float16'>"), dtype_name("uint16", {"uint16": "bfloat16"})
('bfloat16', 'float16', 'bfloat16')
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
COMPUTE_DTYPES = (*FLOAT_DTYPES, "auto")
OUTPUT_DTYPES = (*FLOAT_DTYPES, "unchanged")  # "unchanged": outputs not cast (as torch.autocast/Keras/Paddle give)
LOW_PRECISION = ("float16", "bfloat16")

FLT_MAX = 3.4028234663852886e38  # largest float32: every backend holds the scale in float32
FLT_TINY = 2.0 ** -126  # smallest normal float32: below it a flushing device (XLA:CPU, TensorFlow) gives 0
INT32_MAX = 2**31 - 1  # counters are int32 on device (JAX, TensorFlow); a larger interval wraps
FP8_FORMATS = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}  # the policy's names -> the framework dtypes


def f32(x: float) -> float:
    """Round to the nearest float32 (overflow gives inf; subnormals kept)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


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


def dtype_name(dtype: Any, aliases: Mapping[str, str] | None = None) -> str:
    """unimp's name of a framework dtype object, from its text: ``torch.bfloat16`` / ``paddle.bfloat16`` /
    ``<dtype: 'bfloat16'>`` / ``bfloat16`` -> ``"bfloat16"``. ``aliases`` maps a framework's own names
    (e.g. Paddle stores bfloat16 as numpy ``uint16``)."""
    text = str(dtype)
    if text.startswith("<dtype: '"):
        text = text[len("<dtype: '"):-2]
    text = text.rsplit(".", 1)[-1]
    return (aliases or {}).get(text, text)


UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,  # half the gap above 1.0
                 "e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}  # the FP8 formats (by the policy's names): 3 and 2 mantissa bits


def reference_tolerance(dtype: str, layers: int) -> float:
    """Relative tolerance of one computation in ``dtype`` through ``layers`` computing layers against
    another rounding of it (the framework's own policy at the same weights and batch, or float32):
    the probabilistic rounding-error bound u * sqrt(n) (Higham & Mary, "A New Approach to
    Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019), u the dtype's unit
    roundoff. No CPU enters it, so a test using it holds on every CPU class.

    >>> round(reference_tolerance("float16", 100), 6), reference_tolerance("bfloat16", 4)
    (0.004883, 0.0078125)
    """
    return UNIT_ROUNDOFF[dtype] * layers ** 0.5
