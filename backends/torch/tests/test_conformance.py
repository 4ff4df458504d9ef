"""The shared suite (unimp.conformance) on torch CPU: every check x every standard policy."""

import pytest

from unimp.conformance import cases, run_case

# The core's round-trip check resumes a fresh probe at scale 131072, where float16 really
# overflows (CORE_REQUESTS.md #1); test_training.py covers the same property at a sane scale.
CORE_BUG = {"check_state_dict_roundtrip[mixed_fp16]"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(
    strict=True, reason="core check overflows fp16 for real (CORE_REQUESTS.md #1)")) if str(c) in CORE_BUG
    else c for c in cases()], ids=str)
def test_conformance(case, kit):
    run_case(case, kit)
