"""Loss tolerances derived from dtypes, for comparing a low-precision forward with the framework's own.

A 10-step training trajectory amplifies any rounding difference chaotically, by an amount that
depends on the CPU (MobileNetV2 under Keras' mixed_float16: 0.028 on an AVX512 EPYC, 0.116 on an
AVX2-only one), so the model suites compare each step's loss with the framework's own policy at the
same weights, where only one forward's rounding differs. The bound itself lives in the core
(:func:`unimp.dtypes.reference_tolerance`, shared with the backends' tests): written once.

>>> round(reference_tolerance("float16", 100), 6)
0.004883
"""

from unimp.dtypes import UNIT_ROUNDOFF, reference_tolerance

__all__ = ["UNIT_ROUNDOFF", "reference_tolerance"]
