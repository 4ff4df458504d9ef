"""Which engine runs, and why: IPEX where installed, torch's CPU autocast otherwise (a real subprocess)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unimp
from unimp_ipex.engine import find_engine


@pytest.fixture(scope="module")
def without_ipex():
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("no_ipex.py"))], capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_ipex_the_torch_cpu_path_runs_and_the_plan_says_why(without_ipex):
    assert without_ipex["backend"] == "ipex" and without_ipex["engine"] == "torch"
    assert "intel_extension_for_pytorch is not installed" in without_ipex["reason"]
    assert without_ipex["ipex"] is None and not without_ipex["imported"]
    assert without_ipex["notes"][0].startswith("engine: torch (intel_extension_for_pytorch is not installed")


def test_with_ipex_installed_it_is_chosen_for_cpu_models():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert unimp.detect(model).name == "ipex"  # priority over the torch backend
    amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.backend == "ipex" and amp.plan.details.engine == "ipex"
    assert "intel-extension-for-pytorch 2.8" in amp.plan.details.engine_reason
    assert "engine: ipex" in str(amp.plan)
    amp.remove()


def test_engine_torch_on_request_matches_the_torch_backend():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    amp = unimp.apply("mixed_bf16", model, backend="ipex", engine="torch")
    assert amp.model is model and amp.plan.details.ipex is None
    mine = amp.report(torch.randn(2, 8)).rows
    amp.remove()
    ref = unimp.apply("mixed_bf16", model, backend="torch")
    assert [(r.path, r.compute_dtype, r.param_dtype) for r in mine] == \
        [(r.path, r.compute_dtype, r.param_dtype) for r in ref.report(torch.randn(2, 8)).rows]
    ref.remove()


def test_bad_engine_and_options_are_clear_errors():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="engine: expected 'auto', 'ipex' or 'torch'"):
        unimp.apply("fp32", model, backend="ipex", engine="IPEX")
    with pytest.raises(TypeError, match="unknown options.*engine="):
        unimp.apply("fp32", model, backend="ipex", dtype="bf16")
    assert find_engine("ipex").name == "ipex"


def test_layer_norm_grads_through_ipex_equal_stock_torch(without_ipex):
    """IPEX warns that aten::layer_norm has no autograd kernel; its grads still equal stock torch's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    model.load_state_dict({k: torch.tensor(v) for k, v in without_ipex["state"].items()})
    amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.plan.details.engine == "ipex"
    amp.backward(amp.model(torch.linspace(-2, 2, 64).reshape(4, 16)).square().mean())
    for name, p in amp.model.named_parameters():
        assert torch.equal(p.grad, torch.tensor(without_ipex["grads"][name])), name
    amp.remove()
