"""Tuning an FP8 policy: a model with one layer whose inputs tensorwise FP8 cannot hold.

    unimp tune examples/fp8_tune.py:factory --policy fp8_tensorwise -o tuned.toml
    python examples/fp8_tune.py [--steps 300]

Row 0 of every batch is a "sink" row ten million times larger than the others (as the massive
activations of an LLM's first token), left out of the loss. ``embed`` sees the rows raw: one FP8 scale
for the whole tensor, set by the sink row, flushes every other row to zero, so in FP8 the model cannot
learn; after ``norm`` every row is at unit scale and the other layers are fine in FP8. ``unimp tune``
finds that from four batches and writes a policy keeping ``embed`` in bf16; the script then trains
bf16, all-FP8 and the tuned policy and prints their losses (CPU: FP8 emulated, slow).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import unimp

FEATURES, HIDDEN, OUTPUTS, ROWS = 32, 64, 16, 64
SINK = 1e7  # the sink row: scaled by 448 / 1e7 (e4m3's largest / amax), every other row (|x| < 10) falls below
# half e4m3's smallest subnormal (2^-10) and rounds to 0
NOISE = 0.3  # the targets' noise: the loss a model can reach


class Net(nn.Module):
    """A first projection of the raw rows, a norm, a residual MLP, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, HIDDEN)
        self.down = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x))
        return self.head(h + self.down(torch.relu(self.up(h))))


def batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches of the task (targets a fixed function of the rows, plus noise), each with its sink row."""
    teacher = torch.randn(FEATURES, OUTPUTS, generator=torch.Generator().manual_seed(0)) / FEATURES ** 0.5
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(ROWS, FEATURES, generator=g)
        y = torch.tanh(2 * x @ teacher) + NOISE * torch.randn(ROWS, OUTPUTS, generator=g)
        x[0] = SINK
        out.append((x, y))
    return out


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error over the rows but the sink row."""
    x, y = batch
    return F.mse_loss(model(x)[1:].float(), y[1:])


def model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def factory() -> tuple[Net, list[tuple[torch.Tensor, torch.Tensor]], object]:
    """What ``unimp tune`` runs: the model, a few batches, the loss."""
    return model(), batches(4, seed=1000), loss_fn


def train(policy: object, steps: int) -> float:
    """The mean loss of the last 50 of ``steps`` AdamW steps under ``policy`` (a fresh batch each step)."""
    m = model()
    amp = unimp.apply(policy, m, torch.optim.AdamW(m.parameters(), lr=3e-3))
    losses = []
    for batch in batches(steps, seed=1):
        loss = loss_fn(amp.model, batch)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
    amp.remove()
    tail = losses[-50:]
    return sum(tail) / len(tail)


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    tuned = unimp.tune("fp8_tensorwise", *factory())
    print(tuned.text)
    losses = {name: train(policy, args.steps) for name, policy in
              (("bf16", "mixed_bf16"), ("fp8", "fp8_tensorwise"), ("tuned", tuned.policy))}
    for name, loss in losses.items():
        print(f"{name:6} loss after {args.steps} steps: {loss:.4f} ({loss / losses['bf16'] - 1:+.2%} against bf16)")
    return losses


if __name__ == "__main__":
    main()
