"""unimp.conformance on Keras / TensorFlow CPU: every standard policy, every check."""

import pytest

from unimp.conformance import cases, run_case


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, kit):
    run_case(case, kit)
