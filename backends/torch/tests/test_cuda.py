"""CUDA-only checks (run on the GPU machine; skipped without CUDA)."""

import pytest
import torch
from models import Block, mlp

import unimp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("preset", ["mixed_fp16", "fp16_master", "mixed_bf16", "pure_bf16"])
def test_no_host_device_sync_per_step(preset):
    """Fused AdamW + device-side loss scale: a whole training step never syncs with the host."""
    model = mlp().cuda()
    amp = unimp.apply(preset, model, torch.optim.AdamW(model.parameters(), fused=True))
    x = torch.randn(8, 16, device="cuda")
    for _ in range(2):  # warm-up (first forward observes the model for the report)
        amp.backward(amp.model(x).float().square().mean())
        amp.optimizer.step()
        amp.optimizer.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for poison in (False, True, False):
            loss = amp.model(x).float().square().mean()
            amp.backward(loss * float("inf") if poison else loss)
            amp.optimizer.step()
            amp.optimizer.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    expected = 1 if amp.policy.loss_scale.skip_nonfinite else 0
    assert amp.skipped_steps == expected
    amp.remove()


def test_same_dtypes_on_cuda_as_on_cpu():
    """mixed_bf16 gives the same per-op dtypes on both devices (CPU through unimp's kernels)."""
    seen = {}
    for device in ("cpu", "cuda"):
        block = Block().to(device)
        amp = unimp.apply("mixed_bf16", block)
        amp.model(torch.randn(2, 4, 16, device=device))
        seen[device] = dict(block.seen)
        assert amp.report().row("norm").compute_dtype == "float32"
        amp.remove()
    assert seen["cpu"] == seen["cuda"]
    assert seen["cuda"]["softmax"] == torch.float32 and seen["cuda"]["matmul"] == torch.bfloat16


def test_torch_preset_on_cuda_is_plain_autocast():
    block = Block().cuda()
    amp = unimp.apply("torch_autocast_cuda", block, torch.optim.AdamW(block.parameters(), fused=True))
    from unimp_torch.autocast import has_kernel

    rms_move = {} if has_kernel("rms_norm", "cuda") else {"rms_norm": "float32"}  # torch < 2.13
    assert amp.plan.details.op_moves == rms_move
    assert amp.wrapped == []
    amp.remove()


def test_pure_bf16_masters_on_cuda():
    model = Block().cuda()
    amp = unimp.apply("pure_bf16", model, torch.optim.AdamW(model.parameters(), fused=True))
    for _ in range(3):
        amp.backward(amp.model(torch.randn(2, 4, 16, device="cuda")).float().square().mean())
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        for _, low, master in amp.master_weights:
            assert torch.equal(low, master.to(torch.bfloat16))
    amp.remove()


class _Pool(torch.nn.Module):
    """A linear, then a global average (a classifier's pooling: ``x.mean``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        self.seen = (h.dtype, h.mean(1).dtype, torch.mean(h, dim=(0, 1)).dtype)
        return h.mean(1)


def test_mean_in_float32_under_mixed_presets_and_torchs_own_under_torch_autocast_cuda():
    x = torch.randn(2, 8, 16, device="cuda")
    plain = _Pool().cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        plain(x)
    assert plain.seen == (torch.float16, torch.float16, torch.float16)  # torch's own: mean follows its input
    for preset, want in (("torch_autocast_cuda", plain.seen), ("mixed_bf16", (torch.bfloat16,) + (torch.float32,) * 2),
                         ("mixed_fp16", (torch.float16,) + (torch.float32,) * 2)):
        model = _Pool().cuda()
        amp = unimp.apply(preset, model)
        amp.model(x)
        assert model.seen == want, (preset, model.seen)
        amp.remove()
