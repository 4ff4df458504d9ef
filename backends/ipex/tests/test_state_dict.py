"""Garbage state dicts through the IPEX Amp (both engines): one StateError, nothing applied (issue 14)."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unimp
from unimp.conformance.state_dicts import (
    check_copy,
    check_refused,
    check_removed,
    check_round_trip,
    garbage_state_dicts,
)

# bfloat16 runs on every CPU; a dynamic loss scale makes every counter of the state move
CASES = [("mixed_bf16", "ipex"), ("dynamic_bf16", "ipex"), ("dynamic_bf16", "torch")]
DYNAMIC = {"loss_scale": {"mode": "dynamic", "skip_nonfinite": True, "hysteresis": 2}}


def _apply(name, engine):
    policy = unimp.load("mixed_bf16").replace(**DYNAMIC) if name == "dynamic_bf16" else name
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    amp = unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1), backend="ipex", engine=engine)
    amp.backward(amp.model(torch.randn(4, 8)).float().sum())
    amp.optimizer.step()
    return amp


@pytest.fixture(scope="module", params=CASES, ids=str)
def amp(request):
    a = _apply(*request.param)
    yield a
    a.remove()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_garbage_state_dicts_are_refused_and_change_nothing(amp, data):
    check_refused(amp, data.draw(garbage_state_dicts(amp.state_dict())))


def test_the_largest_valid_state_round_trips(amp):
    check_round_trip(amp)


def test_deepcopy_of_the_amp_works_or_is_refused_clearly(amp):
    check_copy(amp)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_removed_amp_refuses(case):
    check_removed(_apply(*case))
