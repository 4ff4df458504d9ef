"""Dtype names used everywhere in unimp (plain strings, never framework objects).

>>> widest(["bfloat16", "float32"])
'float32'
>>> dtype_name("torch.bfloat16"), dtype_name("<dtype: 'float16'>"), dtype_name("uint16", {"uint16": "bfloat16"})
('bfloat16', 'float16', 'bfloat16')
>>> limits("float16")  # largest finite, smallest normal, smallest subnormal
Limits(max=65504.0, min_normal=6.103515625e-05, min_subnormal=5.960464477539063e-08)
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

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
        rounded: float = struct.unpack("f", struct.pack("f", x))[0]
        return rounded
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
    root: float = layers ** 0.5
    return UNIT_ROUNDOFF[dtype] * root


class Limits(NamedTuple):
    """The range of a floating format: its largest finite value, its smallest normal and its smallest
    subnormal (positive) value. A value of magnitude above ``max`` overflows (to inf, or to NaN in a
    format without inf), one at or below ``min_subnormal / 2`` rounds to zero (underflow), one between
    that and ``min_normal`` is subnormal (fewer significant bits)."""

    max: float
    min_normal: float
    min_subnormal: float

    # Where a value rounds to when cast to this format (round to nearest, ties to even): ``|x| >= overflow_at``
    # is not finite (inf; NaN in a format without inf), ``0 < |x| <= underflow_at`` becomes 0, and
    # ``underflow_at < |x| < normal_from`` becomes subnormal.
    @property
    def overflow_at(self) -> float:
        """``max`` plus half its unit in the last place (a tie rounds to the even neighbour: overflow).

        >>> limits("float16").overflow_at, limits("float8_e4m3fn").overflow_at
        (65520.0, 464.0)
        """
        mantissa = round(math.log2(self.min_normal / self.min_subnormal))
        return self.max + 2.0 ** (math.floor(math.log2(self.max)) - mantissa) / 2

    @property
    def underflow_at(self) -> float:
        """Half the smallest subnormal (a tie rounds to the even neighbour: zero)."""
        return self.min_subnormal / 2

    @property
    def normal_from(self) -> float:
        """Halfway between the largest subnormal and the smallest normal (a tie rounds to the normal)."""
        return self.min_normal - self.min_subnormal / 2


# exponent bits, mantissa bits, and whether the top exponent is reserved for inf/NaN (IEEE) or holds
# finite values with only the all-ones pattern as NaN (the "fn" FP8 format: no inf)
_FORMATS = {"float16": (5, 10, True), "bfloat16": (8, 7, True), "float32": (8, 23, True), "float64": (11, 52, True),
            "float8_e4m3fn": (4, 3, False), "float8_e5m2": (5, 2, True)}


def limits(dtype: Any) -> Limits:
    """:class:`Limits` of a floating dtype (a name, or a framework dtype read by :func:`dtype_name`),
    from its bit layout: bias ``2^(e-1) - 1``, smallest normal ``2^(1 - bias)``, smallest subnormal
    ``2^(1 - bias - m)``; the largest finite value has the top exponent below inf (IEEE) or, in
    ``float8_e4m3fn``, the top exponent with every mantissa bit but the last set (448).

    >>> limits("bfloat16").max == 2.0 ** 127 * (2 - 2.0 ** -7), limits("float32").max == FLT_MAX
    (True, True)
    >>> limits("float8_e4m3fn"), limits("float8_e5m2").max
    (Limits(max=448.0, min_normal=0.015625, min_subnormal=0.001953125), 57344.0)
    """
    name = dtype_name(dtype)
    if name not in _FORMATS:
        raise ValueError(f"limits({dtype!r}): not a floating format unimp knows; known: {', '.join(_FORMATS)}")
    e, m, ieee = _FORMATS[name]
    bias = 2 ** (e - 1) - 1
    top = 2 ** e - 1 - bias  # the all-ones exponent
    largest = (2.0 - 2.0 ** (1 - m)) * 2.0 ** top if not ieee else (2.0 - 2.0 ** -m) * 2.0 ** (top - 1)
    return Limits(largest, 2.0 ** (1 - bias), 2.0 ** (1 - bias - m))
