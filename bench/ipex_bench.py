"""CPU training-step benchmark: fp32 vs native torch CPU autocast bf16 vs native IPEX bf16 vs unimp.

One process, every variant of a model timed round-robin (one step each in turn, so drift from
other load hits them alike); the figure is the median of ``--steps`` steps after ``--warmup``.

    python bench/ipex_bench.py --steps 30 --warmup 5

unimp/native pairs (same op lists, same param dtypes, so the ratio is unimp's overhead):
  unimp ipex  (policy torch_autocast_cpu) / native torch autocast
  unimp torch (policy torch_autocast_cpu) / native torch autocast
  unimp ipex, engine torch (the no-IPEX path) / native torch autocast
  unimp ipex  (policy IPEX_BF16 below: bf16 params + IPEX masters) / native IPEX bf16
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

import unimp

# torch's CPU lists with bf16 weights as ipex.optimize(dtype=bf16) makes them (norm params fp32)
IPEX_BF16 = {"name": "ipex_bf16", "extends": "torch_autocast_cpu", "param_dtype": "bfloat16",
             "master_weights": {"enabled": True},
             "overrides": [{"types": ["layer_norm", "batch_norm"], "param_dtype": "float32"}]}


class Block(nn.Module):
    """Pre-norm transformer block: attention (sdpa) + GELU MLP."""

    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 16))


def native_step(model, opt, autocast: bool):
    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def unimp_step(amp):
    def step(x):
        loss = amp.model(x).float().square().mean()
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
    return step


def variants(base: nn.Module):
    import intel_extension_for_pytorch as ipex

    def fresh():
        m = copy.deepcopy(base)
        return m, torch.optim.Adam(m.parameters(), lr=1e-4)

    m, o = fresh()
    yield "fp32", native_step(m, o, False)
    m, o = fresh()
    yield "native torch autocast bf16", native_step(m, o, True)
    m, o = fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        im, io_ = ipex.optimize(m, optimizer=o, dtype=torch.bfloat16)
    yield "native IPEX bf16", native_step(im, io_, True)
    for label, policy, kw in (("unimp ipex torch_autocast_cpu", "torch_autocast_cpu", {"backend": "ipex"}),
                              ("unimp torch torch_autocast_cpu", "torch_autocast_cpu", {"backend": "torch"}),
                              ("unimp ipex(engine torch) torch_autocast_cpu", "torch_autocast_cpu",
                               {"backend": "ipex", "engine": "torch"}),
                              ("unimp ipex ipex_bf16", IPEX_BF16, {"backend": "ipex"}),
                              ("unimp ipex mixed_bf16", "mixed_bf16", {"backend": "ipex"}),
                              ("unimp ipex pure_bf16", "pure_bf16", {"backend": "ipex"})):
        m, o = fresh()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            amp = unimp.apply(policy, m, o, **kw)
        yield label, unimp_step(amp)


PAIRS = (("unimp ipex torch_autocast_cpu", "native torch autocast bf16"),
         ("unimp torch torch_autocast_cpu", "native torch autocast bf16"),
         ("unimp ipex(engine torch) torch_autocast_cpu", "native torch autocast bf16"),
         ("unimp ipex ipex_bf16", "native IPEX bf16"))


def bench(name: str, base: nn.Module, x: torch.Tensor, steps: int, warmup: int) -> dict[str, float]:
    runs = dict(variants(base))
    times: dict[str, list[float]] = {k: [] for k in runs}
    labels = list(runs)
    for i in range(warmup + steps):
        k = i % len(labels)  # rotate the order so no variant always follows the same one
        for label in labels[k:] + labels[:k]:
            step = runs[label]
            t0 = time.perf_counter()
            step(x)
            if i >= warmup:
                times[label].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\n## {name} (median of {steps} steps after {warmup} warm-up, ms/step)\n")
    print("| variant | ms | vs fp32 |\n|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {med['fp32'] / v:.2f}x |")
    print("\n| unimp / native | ratio |\n|---|---:|")
    for a, b in PAIRS:
        print(f"| {a} / {b} | {med[a] / med[b]:.3f} |")
    return med


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    import intel_extension_for_pytorch as ipex

    from unimp_ipex.hardware import here

    torch.manual_seed(0)
    print(f"torch {torch.__version__}, IPEX {ipex.__version__}, {torch.get_num_threads()} threads, "
          f"CPU: {here().describe()}")
    bench("transformer block d=256 T=128 b=8", Block(), torch.randn(8, 128, 256), args.steps, args.warmup)
    bench("small CNN b=16 3x32x32", cnn(), torch.randn(16, 3, 32, 32), args.steps, args.warmup)


if __name__ == "__main__":
    main()
