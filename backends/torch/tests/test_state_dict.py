"""Garbage state dicts through the torch Amp: one StateError, nothing applied (issue 14, item 13)."""

import pytest
import torch

import unimp
from unimp.conformance.state_dicts import amp_checks, check_removed

POLICIES = ["mixed_fp16", "fp16_master", "mixed_bf16", "deepspeed_fp16"]


def _apply(policy):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    return unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.fixture(scope="module", params=POLICIES)
def amp(request):
    a = _apply(request.param)
    loss = a.model(torch.randn(4, 8)).float().sum()
    a.backward(loss)
    a.optimizer.step()
    yield a
    a.remove()


(test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
 test_deepcopy_of_the_amp_works_or_is_refused_clearly) = amp_checks(max_examples=40)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_removed_amp_refuses(policy):
    check_removed(_apply(policy))
