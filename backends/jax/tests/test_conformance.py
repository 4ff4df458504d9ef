"""The core's conformance suite, for the nnx and the linen probe (expected values from the core)."""

import warnings

import pytest

from unimp.backend import UnimpWarning
from unimp.conformance import cases, run_case


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, kit):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)  # bf16/fp16 on XLA:CPU is slow: expected here
        run_case(case, kit)
