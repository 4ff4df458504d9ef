"""unimp.conformance on Keras / TensorFlow CPU: every standard policy, every check."""

import pytest

from unimp import load
from unimp.conformance import cases, run_case
from unimp.conformance.checks import check_loss_scale_trajectory, check_state_dict_roundtrip

# Genuine float16 overflow (borderline: most runs, depending on threaded reduction order) (not a backend bug): after resuming at scale 2**17 the fresh
# probe's fc1/conv bias and head kernel gradients exceed 65504 in float16, so the step is skipped
# while the check assumes every unpoisoned step is finite. See CORE_REQUESTS.md (1).
KNOWN_CORE_ISSUES = {
    "check_state_dict_roundtrip[mixed_fp16]": "float16 overflow at scale 2**17 (CORE_REQUESTS.md 1)",
}


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case, kit, request):
    if str(case) in KNOWN_CORE_ISSUES:  # still run: XPASS once the core check changes
        request.applymarker(pytest.mark.xfail(reason=KNOWN_CORE_ISSUES[str(case)], strict=False))
    run_case(case, kit)


@pytest.mark.parametrize("check", [check_state_dict_roundtrip, check_loss_scale_trajectory])
def test_fp16_loss_scale_checks_below_overflow(check, kit):
    """The same core checks for fp16 from a scale the probe's fp16 gradients cannot overflow."""
    check(kit, load("mixed_fp16").replace(loss_scale={"initial": 1024.0}))
