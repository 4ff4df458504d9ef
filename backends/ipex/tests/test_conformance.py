"""The shared suite (unimp.conformance) through backend ipex on this CPU, with IPEX as the engine."""

import pytest

from unimp.conformance import cases, run_case


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, kit):
    assert kit.engine == "auto"
    run_case(case, kit)
