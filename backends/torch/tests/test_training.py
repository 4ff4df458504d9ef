"""The training loop of docs/design.md on real models: accumulation, clipping, skips, masters, remove, state."""

import json

import pytest
import torch
from models import Block, ConvNet, mlp

import unimp


def step(amp, x, poison=False):
    loss = amp.model(x).float().square().mean()
    amp.backward(loss * float("inf") if poison else loss)
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    return float(loss.detach())


def everything(amp):
    """Params, masters and every optimizer-state tensor, exact."""
    opt = amp.optimizer.optimizer
    out = [p.detach().clone() for p in amp.model.parameters()]
    out += [m.detach().clone() for _, _, m in amp.master_weights]
    out += [v.clone() for p in opt.state for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("preset", ["mixed_fp16", "fp16_master"])
def test_skipped_step_changes_no_bit(opt, preset):
    model = mlp()
    skipped = []
    amp = unimp.apply(preset, model, OPTIMIZERS[opt](model.parameters()), on_skip=lambda: skipped.append(1))
    x = torch.randn(8, 16)
    for _ in range(2):
        step(amp, x)
    before = everything(amp)
    step(amp, x, poison=True)
    after = everything(amp)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert amp.skipped_steps == 1 and skipped == [1] and amp.scale == 32768.0
    step(amp, x)
    assert not all(torch.equal(a, b) for a, b in zip(before, everything(amp)))  # a real step moves
    amp.remove()


@pytest.mark.parametrize("opt", ["adam", "adamw_fused"])
def test_master_weights_track_every_step(opt):
    model = Block()
    amp = unimp.apply("pure_bf16", model, OPTIMIZERS[opt](model.parameters()))
    assert model.norm.weight.dtype == torch.float32 and model.qkv.weight.dtype == torch.bfloat16
    masters = {n: m for n, _, m in amp.master_weights}
    assert set(masters) == {"qkv.weight", "qkv.bias", "proj.weight", "proj.bias"}
    for _ in range(3):
        step(amp, torch.randn(2, 4, 16))
        for _, low, master in amp.master_weights:
            assert master.dtype == torch.float32 and torch.equal(low, master.to(torch.bfloat16))
    amp.remove()
    assert model.qkv.weight is masters["qkv.weight"] and model.qkv.weight.dtype == torch.float32


def test_gradient_accumulation_and_clipping_on_unscaled_grads():
    policy = unimp.load("fp32").replace(loss_scale={"mode": "dynamic", "skip_nonfinite": True})
    ref, ours = mlp(), mlp()
    amp = unimp.apply(policy, ours, torch.optim.SGD(ours.parameters(), lr=0.1))
    xs = torch.randn(3, 4, 16)
    for x in xs:  # accumulate three micro-batches
        ref(x).square().mean().backward()
        amp.backward(amp.model(x).square().mean())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    our_norm = amp.clip_grad_norm_(0.5)
    # the scale is a power of two: scaling, summing the scaled micro-batch grads and unscaling round
    # exactly as the plain sums do (no overflow or underflow here), so bit for bit
    assert torch.equal(ref_norm, our_norm)
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a.grad, b.grad)
    amp.optimizer.step()
    assert amp.scale == 65536.0 and amp.skipped_steps == 0


def test_channels_last_and_remove_restores_exactly():
    model = ConvNet()
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        out_before = model(x)
    amp = unimp.apply("pure_bf16", model, torch.optim.AdamW(model.parameters(), fused=True))
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert model.conv.weight.dtype == torch.bfloat16 and model.bn.weight.dtype == torch.float32
    with torch.no_grad():
        amp.model(x)
    report = amp.report()
    assert report.row("conv").compute_dtype == "bfloat16" and report.row("bn").param_dtype == "float32"
    with pytest.raises(RuntimeError, match="already"):
        unimp.apply("pure_bf16", model)
    amp.remove()
    for n, p in model.named_parameters():
        original, value = params[n]
        assert p is original and p.dtype == torch.float32 and p.is_contiguous() and torch.equal(p, value)
    assert "forward" not in model.__dict__
    with torch.no_grad():
        assert torch.equal(model(x), out_before)


def test_loop_learns_and_lr_scheduler_accepts_the_wrapper():
    model = mlp()
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sched = torch.optim.lr_scheduler.StepLR(amp.optimizer, step_size=5)
    x, y = torch.randn(32, 16), torch.randn(32, 8)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(amp.model(x), y)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        sched.step()
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    assert amp.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.1**4)
    amp.remove()


def test_state_dict_roundtrip_fp16_resumes_exactly():
    """State-dict round trip under float16 at a scale fp16 can hold (the conformance check uses a small scale)."""
    policy = unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 2, "initial": 256.0})
    pattern = [False, False, True, False, False, False, True, True, False, False, False]
    rule = unimp.LossScale(policy.loss_scale)
    model = mlp()
    amp = unimp.apply(policy, model, torch.optim.Adam(model.parameters()))
    x = torch.randn(4, 16)
    for poison in pattern[:5]:
        step(amp, x, poison)
    saved = json.loads(json.dumps(amp.state_dict()))
    amp.remove()
    model2 = mlp()
    amp2 = unimp.apply(policy, model2, torch.optim.Adam(model2.parameters()))
    amp2.load_state_dict(saved)
    state = unimp.LossScaleState.from_dict(saved)
    for poison in pattern[5:]:
        step(amp2, x, poison)
        state = rule.update(state, not poison).state
        assert (amp2.scale, amp2.skipped_steps) == (state.scale, state.skipped)
    assert amp2.loss_scale_state() == state
    amp2.remove()
