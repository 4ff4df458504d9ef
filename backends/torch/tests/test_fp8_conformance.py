"""The conformance suite's FP8 checks (unimp.conformance.fp8) on the torch backend."""

import pytest

from unimp.conformance import run_case
from unimp.conformance.fp8 import fp8_cases


@pytest.mark.parametrize("case", fp8_cases(), ids=str)
def test_fp8_conformance(case, kit):
    run_case(case, kit)
