"""Bad input: a clear error naming the argument and the fix; nothing of the model is lost."""

import pytest
import torch
from models import mlp

import unimp


def test_non_module():
    with pytest.raises(TypeError, match="no unimp backend accepts"):
        unimp.apply("mixed_bf16", lambda x: x)
    with pytest.raises(TypeError, match="it takes torch.nn.Module"):
        unimp.apply("mixed_bf16", {"weight": 1}, backend="torch")
    backend = unimp.get_backend("torch")
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module, got dict"):
        backend.apply(backend.compile(unimp.load("mixed_bf16")), {"weight": 1})


def test_optimizer_over_other_params():
    model = mlp()
    other = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer: param_groups\[0\]\['params'\]\[0\].*model.parameters"):
        unimp.apply("mixed_bf16", model, other)
    assert "forward" not in model.__dict__
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer"):
        unimp.apply("mixed_bf16", model, "adam")


def test_apply_twice_and_again_after_remove():
    model = mlp()
    amp = unimp.apply("mixed_bf16", model)
    with pytest.raises(RuntimeError, match="already has a unimp policy applied; call amp.remove"):
        unimp.apply("mixed_fp16", model)
    amp.remove()
    unimp.apply("mixed_fp16", model).remove()


def test_misaligned_error_names_every_path_and_undoes():
    model = mlp()
    with pytest.raises(unimp.UnsupportedError, match=r"(?s)0: in_features=16.*3: out_features=8.*fix"):
        unimp.apply(unimp.load("pure_bf16").replace(layout={"align": 64, "on_misaligned": "error"}), model)
    assert model[0].weight.dtype == torch.float32 and not unimp.backend.registry.is_applied(model)


def test_bad_options_and_closure():
    model = mlp()
    with pytest.raises(TypeError, match="on_skip: expected a callable"):
        unimp.apply("mixed_fp16", model, on_skip=3)
    with pytest.raises(TypeError, match="unknown options"):
        unimp.apply("mixed_fp16", model, scaler=True)
    amp = unimp.apply("mixed_fp16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(unimp.UnsupportedError, match="closure"):
        amp.optimizer.step(lambda: 0.0)
    amp.remove()


def test_device_without_autocast():
    model = mlp().to("meta")
    with pytest.raises(unimp.UnsupportedError, match="cpu or cuda.*model.to"):
        unimp.apply("mixed_bf16", model)


def test_report_before_any_forward():
    amp = unimp.apply("mixed_bf16", mlp())
    with pytest.raises(RuntimeError, match=r"run amp.model\(x\) once first, or pass an example input"):
        amp.report()
    amp.remove()
