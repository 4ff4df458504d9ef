"""The shared suite (unimp.conformance) on torch CPU: every check x every standard policy."""

import pytest

from unimp.conformance import cases, run_case


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, kit):
    run_case(case, kit)
