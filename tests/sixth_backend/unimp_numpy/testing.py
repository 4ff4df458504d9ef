"""The conformance kit of the NumPy backend (the probe built from unimp_numpy.nn layers)."""

from __future__ import annotations

from typing import Any

import numpy as np

from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import ProbeBatch
from unimp.spi import PlanRequest

from . import nn


class NumpyKit(Kit):
    backend = "numpy"

    def supports(self, request: PlanRequest) -> str | None:
        if "bfloat16" in {request.param_dtype, *(d for _, d in request.compute_requests())}:
            return "numpy has no bfloat16 dtype"
        if request.low_precision_params:
            return "the numpy backend keeps params in float32"
        return None

    def build_probe(self, weights: dict[str, Any]) -> nn.Model:
        w = {k: np.array(v, np.float32) for k, v in weights.items()}
        return nn.Model([
            ("embed", nn.Embedding(w["embed.weight"])), ("fc1", nn.Linear(w["fc1.weight"], w["fc1.bias"])),
            ("act", nn.ReLU()), ("conv", nn.Conv1d(w["conv.weight"], w["conv.bias"])),
            ("norm", nn.LayerNorm(w["norm.weight"], w["norm.bias"])),
            ("head", nn.Linear(w["head.weight"], w["head.bias"])), ("logp", nn.LogSoftmax())])

    def make_optimizer(self, model: nn.Model, lr: float = 1e-2) -> nn.Adam:
        return nn.Adam(model, lr)

    def make_sgd(self, model: nn.Model, lr: float = 0.1) -> nn.SGD:
        return nn.SGD(model, lr)

    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        return {r.path: Observation(r.compute_dtype, r.param_dtype, r.output_dtype)
                for r in amp.report(batch.tokens).rows}

    def output(self, amp: Any, batch: ProbeBatch) -> np.ndarray:
        return amp.model(batch.tokens)

    def dtype_name(self, value: Any) -> str:
        return np.asarray(value).dtype.name

    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        logp = amp.model(batch.tokens).astype(np.float32)
        picked = np.take_along_axis(logp, batch.targets[..., None], -1)
        loss = float(-picked.mean())
        grad = np.zeros_like(logp)
        np.put_along_axis(grad, batch.targets[..., None], -1.0 / picked.size, -1)
        with np.errstate(invalid="ignore"):  # poison: inf * 0 = nan gradients, as asked
            amp.backward(grad * np.float32(np.inf if poison else 1.0))
        amp.step()
        return loss

    def snapshot(self, amp: Any) -> dict[str, Any]:
        state = {f"opt.{k}": np.copy(v) for k, v in amp.optimizer.state.items()}
        return {**{k: np.copy(v) for k, v in amp.model.named_params().items()}, **state}

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        return []

    def model_state(self, model: nn.Model) -> dict[str, tuple[str, Any]]:
        return {k: (v.dtype.name, np.copy(v)) for k, v in model.named_params().items()}

    def export_weights(self, amp: Any) -> dict[str, Any]:
        return {k: np.copy(v) for k, v in amp.model.named_params().items()}

    def forward_fingerprint(self, model: nn.Model, batch: ProbeBatch) -> Any:
        return model(batch.tokens)
