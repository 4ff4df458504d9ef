"""Garbage state dicts through the IPEX Amp (both engines): one StateError, nothing applied (issue 14)."""

import pytest
import torch

import unimp
from unimp.conformance.state_dicts import amp_checks, check_removed

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


(test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
 test_deepcopy_of_the_amp_works_or_is_refused_clearly) = amp_checks()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_removed_amp_refuses(case):
    check_removed(_apply(*case))
