"""FP8 training with torch + torchao through a unimp preset, next to bf16 (CPU: emulated FP8, slow).

    python examples/fp8_torch.py [--steps 40] [--policy fp8_tensorwise]

Every Linear whose dims are multiples of 16 trains in FP8 (torchao float8, the preset's recipe); the
rest runs bf16. Prints the report's FP8 column and the losses against ``mixed_bf16``.
"""

from __future__ import annotations

import fp8_compare  # examples/fp8_compare.py, beside this file
import torch
import torch.nn.functional as F
from torch import nn

import unimp


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 16))


def train(policy: str, steps: int) -> tuple[list[float], unimp.Amp]:
    m = model()
    amp = unimp.apply(policy, m, torch.optim.AdamW(m.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 64, generator=g), torch.randint(0, 16, (256,), generator=g)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(amp.model(x).float(), y)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
    return losses, amp


def main(argv: list[str] | None = None) -> tuple[list[float], list[float]]:
    return fp8_compare.main(__doc__, train, "steps", "fp8_tensorwise", argv)


if __name__ == "__main__":
    main()
