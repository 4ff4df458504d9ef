"""`unimp import/export` against the real torch objects: torch.amp.GradScaler (torch kwargs,
Accelerate GradScalerKwargs, Lightning "16-mixed") replays the imported policy's reference
trajectory, and a GradScaler built from an export replays the policy's."""

import math
import random

import pytest
import torch

import unimp
from unimp.loss_scale import trajectory
from unimp.migrate import exporters, importers


def _finites(seed, n, p_bad=0.25):
    rng = random.Random(seed)
    return [rng.random() > p_bad for _ in range(n)]


def _real(scaler, finites):
    """Scale after each step of the real GradScaler driven with (in)finite gradients."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    scales = []
    for finite in finites:
        scaler.scale(p.sum()).backward()
        if not finite:
            p.grad.fill_(math.inf)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def _kwargs(seed):
    rng = random.Random(seed)
    return {"init_scale": 2.0 ** rng.randint(-3, 20), "growth_factor": rng.choice([2.0, 4.0, 1.5]),
            "backoff_factor": rng.choice([0.5, 0.25, 0.125]), "growth_interval": rng.randint(1, 5)}


@pytest.mark.parametrize("seed", range(4))
def test_imported_gradscaler_kwargs_replay_like_gradscaler(seed):
    kw = _kwargs(seed)
    policy = importers.torch(device="cpu", **kw).policy
    finites = _finites(seed, 150)
    assert trajectory(policy.loss_scale, finites)[0] == _real(torch.amp.GradScaler("cpu", **kw), finites)


def test_imported_accelerate_and_lightning_replay_like_their_gradscaler():
    kw = _kwargs(7)
    finites = _finites(7, 150)
    acc = importers.accelerate("fp16", kw).policy
    assert trajectory(acc.loss_scale, finites)[0] == _real(torch.amp.GradScaler("cpu", **kw), finites)
    # Lightning "16-mixed" builds GradScaler() with torch's defaults: 2000 clean steps to the first growth
    finites = [True] * 2001 + _finites(8, 40) + [True] * 2000
    light = importers.lightning("16-mixed").policy
    assert trajectory(light.loss_scale, finites)[0] == _real(torch.amp.GradScaler("cpu"), finites)


@pytest.mark.parametrize("seed", range(3))
def test_exported_gradscaler_replays_the_policy(seed):
    kw = _kwargs(seed + 10)
    policy = unimp.load("torch_autocast_cuda").replace(loss_scale={
        "initial": kw["init_scale"], "growth_factor": kw["growth_factor"], "backoff_factor": kw["backoff_factor"],
        "growth_interval": kw["growth_interval"]})
    out = exporters.torch(policy)
    assert out.unexpressed == ()
    finites = _finites(seed, 150)
    native = {k: v for k, v in out.config["GradScaler"].items() if k != "device"}
    assert _real(torch.amp.GradScaler("cpu", **native), finites) == trajectory(policy.loss_scale, finites)[0]


def test_export_lists_the_cap_torch_cannot_express():
    policy = unimp.load("mixed_fp16").replace(loss_scale={"initial": 2.0**23, "growth_interval": 1})
    out = exporters.torch(policy)
    assert any(line.startswith("loss_scale.max = 16777216.0") for line in out.unexpressed)
    # and the cap is exactly what differs: the real GradScaler passes it
    finites = [True] * 4
    native = {k: v for k, v in out.config["GradScaler"].items() if k != "device"}
    assert _real(torch.amp.GradScaler("cpu", **native), finites) != trajectory(policy.loss_scale, finites)[0]
    with pytest.raises(unimp.UnsupportedError, match="loss_scale.max"):
        out.strict()
