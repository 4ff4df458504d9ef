"""Loss scaling at its bounds on the IPEX backend (issue 27 item 8): it reuses unimp_torch's device
scaler, and a state with every counter at the int32 bound loads and steps through a real step of both
engines as the reference :class:`unimp.LossScale` does."""

import pytest
import torch

import unimp
from unimp.conformance.state_dicts import check_counters_at_bound
from unimp.policy.spec import INT32_MAX

DYNAMIC = {"loss_scale": {"mode": "dynamic", "skip_nonfinite": True, "hysteresis": 2}}


def _apply(engine):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    return unimp.apply(unimp.load("mixed_bf16").replace(**DYNAMIC), model,
                       torch.optim.SGD(model.parameters(), lr=0.1), backend="ipex", engine=engine)


def _step(amp, finite=True):
    amp.backward(amp.model(torch.randn(4, 8) * (1.0 if finite else float("inf"))).float().sum())
    amp.optimizer.step()
    amp.optimizer.zero_grad()


@pytest.mark.parametrize("engine", ["ipex", "torch"])
@pytest.mark.parametrize("finite", [True, False])
def test_counters_at_the_int32_bound_step_as_the_reference(engine, finite):
    amp = _apply(engine)
    _step(amp)
    st = check_counters_at_bound(amp, _step, finite)
    assert (st.steps, st.skipped) == (INT32_MAX, INT32_MAX)
    assert (st.growth_tracker, st.scale) == ((0, 2048.0) if finite else (0, 1024.0))
    amp.remove()
