"""Train a small CNN + transformer on synthetic data under a unimp policy (vs fp32), on CPU or CUDA.

    python examples/torch_train.py [POLICY] [--auto]   # default: examples/team_policy.toml

Prints the unimp report (what ran in which dtype), the loss curves, time per step and memory
(tensors saved for backward + parameters/grads/optimizer state) against float32. ``--auto`` runs
the policy with ``compute_dtype = "auto"`` (the fastest dtype this machine has native units for);
on a CPU without native units for the policy's dtype the demo says it is emulated there.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import unimp
from unimp import hardware

STEPS, BATCH, CLASSES = 30, 32, 10


class ConvTransformer(nn.Module):
    """conv stem -> 8x8 tokens -> one pre-norm attention block -> mean pool -> head."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                  nn.Conv2d(32, d, 3, stride=4, padding=1))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)  # (B, 64, d)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(1))


def data(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    x = torch.randn(BATCH, 3, 32, 32, generator=g) * 0.5
    x[torch.arange(BATCH), y % 3, :, :] += (y[:, None, None] / CLASSES)  # a learnable signal
    return x.to(device), y.to(device)


def memory(amp: unimp.Amp | None, model: nn.Module, opt: torch.optim.Optimizer, x, y) -> float:
    """MiB held for backward in one step + params, grads and optimizer state."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        out = (amp.model if amp else model)(x)
    F.cross_entropy(out.float(), y).backward()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    masters = [m for _, _, m in amp.master_weights] if amp and hasattr(amp, "master_weights") else []
    held = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *state, *masters]
    opt.zero_grad()
    return (sum(saved) + sum(t.numel() * t.element_size() for t in held)) / 2**20


def train(policy: unimp.Policy | None, device: str) -> dict:
    torch.manual_seed(0)
    model = ConvTransformer().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    amp = unimp.apply(policy, model, opt) if policy is not None else None
    x, y = data(device)
    losses, times = [], []
    for _ in range(STEPS):
        t = time.perf_counter()
        loss = F.cross_entropy((amp.model if amp else model)(x).float(), y)
        if amp:
            amp.backward(loss)
            amp.optimizer.step()
            amp.optimizer.zero_grad()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(float(loss.detach()))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    mem = memory(amp, model, amp.optimizer if amp else opt, x, y)
    result = {"losses": losses, "ms": 1e3 * sorted(times[5:])[len(times[5:]) // 2], "mib": mem,
              "report": amp.report() if amp else None}
    if amp:
        amp.remove()
    return result


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--auto"]
    source = args[0] if args else str(Path(__file__).with_name("team_policy.toml"))
    policy = unimp.load(source)
    if "--auto" in sys.argv[1:]:
        policy = policy.replace(compute_dtype="auto")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plan = unimp.get_backend("torch").compile(policy, ConvTransformer().to(device))
    print(plan)
    base, ours = train(None, device), train(policy, device)
    print()
    print(ours["report"])
    print(f"\nloss curve (every 5th step), {device}:")
    print("  fp32  :", " ".join(f"{v:.3f}" for v in base["losses"][::5]), f"-> {base['losses'][-1]:.3f}")
    print("  policy:", " ".join(f"{v:.3f}" for v in ours["losses"][::5]), f"-> {ours['losses'][-1]:.3f}")
    print(f"time per step (median): fp32 {base['ms']:.1f} ms, policy {ours['ms']:.1f} ms "
          f"({base['ms'] / ours['ms']:.2f}x)")
    print(f"memory (saved for backward + params/grads/optimizer state): fp32 {base['mib']:.1f} MiB, "
          f"policy {ours['mib']:.1f} MiB")
    if device == "cpu" and hardware.cpu().emulated(plan.compute_dtype):
        print(f"\nnote: this CPU, {hardware.cpu().describe()}, has no native {plan.compute_dtype} units: the "
              f"policy's {plan.compute_dtype} is emulated here ({base['ms'] / ours['ms']:.2f}x the speed of "
              f"float32 above). Run the fastest dtype this machine has with compute_dtype = \"auto\":\n"
              f"  python {sys.argv[0]} {source} --auto")


if __name__ == "__main__":
    main()
