"""unimp.conformance: the suite any backend runs (scikit-learn's ``check_estimator`` style).

In a backend's tests::

    import pytest
    from unimp.conformance import cases, run_case
    from unimp_mine.testing import MyKit

    @pytest.mark.parametrize("case", cases(), ids=str)
    def test_conformance(case):
        run_case(case, MyKit())   # skips NotApplicable with its reason
"""

from unimp.conformance.checks import (
    CHECKS,
    CUSTOM_MOVED_OPS,
    STANDARD_POLICIES,
    Case,
    ConformanceFailure,
    NotApplicable,
    Result,
    cases,
    cast_like,
    run,
    setup,
    standard_policy,
)
from unimp.conformance.expect import Expect, expected_layers
from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import PROBE, ProbeBatch, probe_batches, probe_weights, reference_forward, reference_loss


def run_case(case: Case, kit: Kit) -> None:
    """Run one case under pytest: NotApplicable becomes a skip with its reason."""
    import pytest

    try:
        case.run(kit)
    except NotApplicable as e:
        pytest.skip(str(e))


__all__ = [
    "CHECKS", "CUSTOM_MOVED_OPS", "PROBE", "STANDARD_POLICIES", "Case", "ConformanceFailure", "Expect",
    "Kit", "NotApplicable", "Observation", "ProbeBatch", "Result", "cases", "cast_like",
    "expected_layers", "probe_batches", "probe_weights", "reference_forward", "reference_loss", "run",
    "run_case", "setup", "standard_policy",
]
