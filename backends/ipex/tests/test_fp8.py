"""FP8 policies on IPEX: a clear UnsupportedError naming what is missing, or the reported fallback."""

import pytest
import torch

import unimp


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_rowwise", "te_delayed"])
def test_fp8_is_refused_naming_what_is_missing(preset):
    model = mlp()
    with pytest.raises(unimp.UnsupportedError, match=r"asks FP8 that backend ipex cannot run:\n  unimp-ipex "
                                                     r"drives ipex.optimize on CPU, which trains in "
                                                     r"bfloat16/float16 only.*use the torch backend \(torchao\)"):
        unimp.apply(preset, model, torch.optim.SGD(model.parameters(), lr=0.1), backend="ipex")
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]  # untouched
    model(torch.randn(2, 16))


def test_fp8_fallback_runs_the_compute_dtype_and_reports_it():
    model = mlp()
    amp = unimp.apply({"extends": "fp8_tensorwise", "compute_dtype": "float32", "on_unsupported": "fallback"},
                      model, torch.optim.SGD(model.parameters(), lr=0.1), backend="ipex")
    assert amp.plan.fp8.requested and not amp.plan.fp8.active
    x = torch.randn(4, 16)
    loss = amp.model(x).float().square().mean()
    amp.backward(loss)
    amp.optimizer.step()
    report = amp.report(x)
    assert {r.fp8 for r in report.rows} == {None}
    fallback = "fp8: fallback to the compute dtype: unimp-ipex drives ipex.optimize"
    assert any(n.startswith(fallback) for n in report.notes)
    amp.remove()
