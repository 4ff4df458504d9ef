"""The core's conformance suite on the dygraph path (on CPU: the Plan's reported fallbacks)."""

import pytest

from unimp.conformance import cases, run_case


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, kit):
    run_case(case, kit)
