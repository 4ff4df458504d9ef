"""Loss tolerances derived from dtypes, for comparing a low-precision forward with the framework's own.

A 10-step training trajectory amplifies any rounding difference chaotically, by an amount that
depends on the CPU (MobileNetV2 under Keras' mixed_float16: 0.028 on an AVX512 EPYC, 0.116 on an
AVX2-only one), so the model suites compare each step's loss with the framework's own policy at the
same weights, where only one forward's rounding differs.

>>> round(reference_tolerance("float16", 100), 6)
0.004883
"""

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # half the gap between 1 and the next value


def reference_tolerance(dtype: str, layers: int) -> float:
    """Relative loss tolerance of one forward in ``dtype`` against another rounding of it: the
    probabilistic rounding-error bound u * sqrt(n) (Higham & Mary, "A New Approach to Probabilistic
    Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019), u the dtype's unit roundoff and n
    the layers that compute. No CPU enters it."""
    return UNIT_ROUNDOFF[dtype] * layers ** 0.5
