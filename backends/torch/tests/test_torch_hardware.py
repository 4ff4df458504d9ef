"""CPU facts decide `auto` and the emulation warning (expectations from unimp.hardware, never this machine).

`tox -e hwsim` reruns these under a simulated AVX2-only CPU (UNIMP_CPU_FEATURES=avx2 + ONEDNN_MAX_CPU_ISA).
"""

import warnings

import pytest
import torch

import unimp
from unimp import hardware
from unimp.conformance.checks import check_emulation_warning

pytestmark = pytest.mark.hardware


def first_linear_dtype(amp):
    seen = []
    handle = amp.model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    amp.model(torch.randn(4, 16))
    handle.remove()
    return seen[0]


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def test_auto_on_cpu_is_bf16_only_with_native_units_and_says_which_cpu():
    model = mlp()
    amp = unimp.apply({"extends": "mixed_bf16", "compute_dtype": "auto"}, model,
                      torch.optim.SGD(model.parameters(), lr=0.1), backend="torch")
    facts = hardware.cpu()
    assert amp.plan.compute_dtype == ("bfloat16" if facts.native_bf16 else "float32")
    assert facts.describe() in amp.plan.compute_reason
    assert first_linear_dtype(amp) == getattr(torch, amp.plan.compute_dtype)
    amp.remove()


def test_explicit_bf16_runs_and_warns_at_the_callers_line_only_where_it_is_emulated():
    model = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1), backend="torch")
    check_emulation_warning(caught, amp, __file__)
    loss = amp.model(torch.randn(4, 16)).float().square().mean()
    amp.backward(loss)
    amp.optimizer.step()
    assert first_linear_dtype(amp) == torch.bfloat16  # it runs as asked
    amp.remove()
