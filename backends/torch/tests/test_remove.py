"""After ``amp.remove()``: the handle refuses every verb, the model is exactly the one given (strides too)."""

import pytest
import torch
from torch import nn

import unimp
from unimp.errors import StateError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8))


VERBS = {
    "amp.backward": lambda amp, loss: amp.backward(loss),
    "amp.scale_loss": lambda amp, loss: amp.scale_loss(loss),
    "amp.unscale_": lambda amp, loss: amp.unscale_(),
    "amp.clip_grad_norm_": lambda amp, loss: amp.clip_grad_norm_(1.0),
    "amp.report": lambda amp, loss: amp.report(),
    "amp.state_dict": lambda amp, loss: amp.state_dict(),
    "amp.load_state_dict": lambda amp, loss: amp.load_state_dict({}),
    "amp.scale": lambda amp, loss: amp.scale,
    "amp.skipped_steps": lambda amp, loss: amp.skipped_steps,
    "amp.master_weights": lambda amp, loss: amp.master_weights,
    "amp.masters_in_model": lambda amp, loss: amp.masters_in_model(),
    "amp.ddp": lambda amp, loss: amp.ddp(),
    "amp.optimizer.step": lambda amp, loss: amp.optimizer.step(),
    "amp.optimizer.zero_grad": lambda amp, loss: amp.optimizer.zero_grad(),
    "amp.optimizer.unscale_": lambda amp, loss: amp.optimizer.unscale_(),
    "amp.optimizer.state_dict": lambda amp, loss: amp.optimizer.state_dict(),
    "amp.optimizer.load_state_dict": lambda amp, loss: amp.optimizer.load_state_dict({}),
}


@pytest.mark.parametrize("preset", ["mixed_fp16", "pure_bf16"])
def test_every_verb_refuses_after_remove(preset):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = unimp.apply(preset, model, opt)
    x = torch.randn(4, 16)
    amp.backward(amp.model(x).float().square().mean())
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    amp.remove()
    loss = model(x).square().mean()
    loss.backward()  # the plain model trains as plain torch
    grads = [p.grad.clone() for p in model.parameters()]
    params = [p.detach().clone() for p in model.parameters()]
    for verb, call in VERBS.items():
        with pytest.raises(StateError, match=r"removed.*unimp\.apply") as err:
            call(amp, loss)
        assert verb in str(err.value), (verb, str(err.value))
    for p, g, v in zip(model.parameters(), grads, params, strict=True):  # nothing was unscaled or stepped
        assert torch.equal(p.grad, g) and torch.equal(p, v)
    opt.step()  # the user's own optimizer still works
    assert amp.remove() is model and "removed=True" in repr(amp)


def test_remove_restores_exact_strides_of_1x1_convs():
    """channels_last and contiguous are the same "contiguous" for 1x1 kernels: strides must come back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 1),
                          nn.Conv2d(8, 8, 3, padding=1))
    before = {n: (t.stride(), t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}
    x = torch.randn(2, 8, 6, 6)
    model.eval()
    with torch.no_grad():
        out = model(x)
    assert unimp.load("mixed_bf16").layout.channels_last
    amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[0].weight.stride() != before["0.weight"][0]  # channels_last strides while applied
    amp.remove()
    for n, t in model.state_dict(keep_vars=True).items():
        stride, value = before[n]
        assert t.stride() == stride and torch.equal(t, value), n
    with torch.no_grad():
        assert torch.equal(model(x), out)
