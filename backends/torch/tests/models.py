"""Small real models shared by the tests."""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """A transformer-ish block with functional softmax/exp/sum, so op-level rules show."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2)
        attn = torch.softmax(scores, dim=-1)
        self.seen.update(matmul=scores.dtype, softmax=attn.dtype, exp=scores.exp().dtype,
                         sum=scores.sum(-1).dtype, log_softmax=scores.log_softmax(-1).dtype)
        return x + self.proj(attn @ v)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8))


def train_steps(model: nn.Module, optimizer: Any, data: list, loss_fn: Callable[..., torch.Tensor], amp: Any = None,
                after: Callable[[], None] = lambda: None) -> None:
    """Training steps on ``(x, y)`` batches: ``zero_grad``, the backward of ``loss_fn(model(x), y)``
    (``amp.backward`` when ``amp`` is given), the optimizer's step, then ``after()`` (e.g. an EMA's update)."""
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        if amp is not None:
            amp.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        after()
