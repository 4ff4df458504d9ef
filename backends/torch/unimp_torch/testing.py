"""The conformance kit for torch: the shared probe as a ``torch.nn.Module`` and a real training step.

>>> from unimp.conformance.probe import probe_weights, probe_batches
>>> kit = TorchKit()
>>> model = kit.build_probe(probe_weights())
>>> tuple(kit.forward_fingerprint(model, probe_batches(1)[0]).shape)
(4, 8, 8)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import CHANNELS, CLASSES, HIDDEN, KERNEL, LN_EPS, VOCAB, ProbeBatch


class ChannelsLastConv1d(nn.Conv1d):
    """A Conv1d over ``(batch, time, channels)`` activations, 'same' padding (the probe's conv)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class Probe(nn.Module):
    """embed -> fc1 -> act -> conv -> norm -> head -> logp (``unimp.conformance.probe``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, CHANNELS)
        self.fc1 = nn.Linear(CHANNELS, HIDDEN)
        self.act = nn.ReLU()
        self.conv = ChannelsLastConv1d(HIDDEN, CHANNELS, KERNEL, padding=KERNEL // 2)
        self.norm = nn.LayerNorm(CHANNELS, eps=LN_EPS)
        self.head = nn.Linear(CHANNELS, CLASSES)
        self.logp = nn.LogSoftmax(dim=-1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(self.embed(tokens)))
        return self.logp(self.head(self.norm(self.conv(x))))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.float().numpy() if t.is_floating_point() else t.numpy()


class TorchKit(Kit):
    backend = "torch"

    def __init__(self, device: str = "cpu") -> None:
        self.device = device

    def build_probe(self, weights: dict[str, Any]) -> nn.Module:
        m = Probe()
        w = weights
        with torch.no_grad():
            m.embed.weight.copy_(_t(w["embed.weight"]))
            for name in ("fc1", "head"):
                getattr(m, name).weight.copy_(_t(w[f"{name}.weight"]).T)
                getattr(m, name).bias.copy_(_t(w[f"{name}.bias"]))
            m.conv.weight.copy_(_t(w["conv.weight"]).permute(2, 1, 0))  # (k, in, out) -> (out, in, k)
            m.conv.bias.copy_(_t(w["conv.bias"]))
            m.norm.weight.copy_(_t(w["norm.weight"]))
            m.norm.bias.copy_(_t(w["norm.bias"]))
        return m.to(self.device)

    def make_optimizer(self, model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=lr)

    def make_sgd(self, model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr)

    def _tokens(self, batch: ProbeBatch) -> torch.Tensor:
        return torch.from_numpy(batch.tokens.astype(np.int64)).to(self.device)

    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        return self.observations(amp.report(self._tokens(batch)))

    def output(self, amp: Any, batch: ProbeBatch) -> torch.Tensor:
        with torch.no_grad():
            return amp.model(self._tokens(batch))

    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        logp = amp.model(self._tokens(batch))
        targets = torch.from_numpy(batch.targets.astype(np.int64)).to(self.device)
        loss = nn.functional.nll_loss(logp.float().reshape(-1, CLASSES), targets.reshape(-1))
        value = float(loss.detach())
        amp.backward(loss * float("inf") if poison else loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        return value

    def snapshot(self, amp: Any) -> dict[str, Any]:
        out = {f"param:{n}": _np(p) for n, p in amp.model.named_parameters()}
        out.update({f"master:{n}": _np(m) for n, _, m in amp.master_weights})
        opt = amp.optimizer.optimizer
        for i, p in enumerate(q for g in opt.param_groups for q in g["params"]):
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"state:{i}:{k}"] = _np(v)
        return out

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        return [(n, _np(low), _np(m).astype(np.float32)) for n, low, m in amp.master_weights]

    def export_weights(self, amp: Any) -> dict[str, Any]:
        masters = {n: m for n, _, m in amp.master_weights}
        p = {n: _np(masters.get(n, t)).astype(np.float32) for n, t in amp.model.named_parameters()}
        out = {"embed.weight": p["embed.weight"], "conv.weight": p["conv.weight"].transpose(2, 1, 0),
               "conv.bias": p["conv.bias"], "norm.weight": p["norm.weight"], "norm.bias": p["norm.bias"]}
        for name in ("fc1", "head"):
            out[f"{name}.weight"], out[f"{name}.bias"] = p[f"{name}.weight"].T, p[f"{name}.bias"]
        return {k: np.ascontiguousarray(v) for k, v in out.items()}

    def model_state(self, model: nn.Module) -> dict[str, tuple[str, Any]]:
        out = {}
        for n, t in (*model.named_parameters(), *model.named_buffers()):
            out[n] = (self.dtype_name(t), _np(t))
            out[f"{n}:contiguous"] = ("bool", np.array(t.is_contiguous()))
        out["forward:class"] = ("bool", np.array("forward" not in model.__dict__))
        return out

    def forward_fingerprint(self, model: nn.Module, batch: ProbeBatch) -> Any:
        with torch.no_grad():
            return _np(model(self._tokens(batch)))
