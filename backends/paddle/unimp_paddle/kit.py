"""The Paddle conformance kit (dygraph path): the shared probe as a ``paddle.nn.Layer``.

On CPU Paddle's dygraph AMP does nothing, so the kit applies each policy with
``on_unsupported = "fallback"`` and the checks expect the Plan's fallback dtypes. Requests whose
fallback the core's expectations cannot express (low-precision params, low-precision overrides:
see backends/paddle/CORE_REQUESTS.md) are declared unsupported, and the checks then verify the clear
``UnsupportedError``.

>>> from unimp.conformance import probe_weights
>>> kit = PaddleKit()
>>> [name for name, _ in kit.build_probe(probe_weights()).named_children()]
['embed', 'fc1', 'act', 'conv', 'norm', 'head', 'logp']
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unimp.conformance import Kit, Observation
from unimp.conformance.probe import CHANNELS, CLASSES, HIDDEN, KERNEL, LN_EPS, VOCAB, ProbeBatch
from unimp.policy import Policy

from .dygraph import dtype_name
from .planning import compile_dygraph


def _probe_class() -> Any:
    import paddle

    class Probe(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.embed = paddle.nn.Embedding(VOCAB, CHANNELS)
            self.fc1 = paddle.nn.Linear(CHANNELS, HIDDEN)
            self.act = paddle.nn.ReLU()
            self.conv = paddle.nn.Conv1D(HIDDEN, CHANNELS, KERNEL, padding=KERNEL // 2, data_format="NLC")
            self.norm = paddle.nn.LayerNorm(CHANNELS, epsilon=LN_EPS)
            self.head = paddle.nn.Linear(CHANNELS, CLASSES)
            self.logp = paddle.nn.LogSoftmax(axis=-1)

        def forward(self, tokens: Any) -> Any:
            x = self.act(self.fc1(self.embed(tokens)))
            return self.logp(self.head(self.norm(self.conv(x))))

    return Probe


class PaddleKit(Kit):
    """Drives unimp-paddle's dygraph path through the conformance checks."""

    backend = "paddle"

    def _place(self) -> str:
        import paddle

        return "gpu" if paddle.device.get_device().startswith("gpu") else "cpu"

    def supports(self, policy: Policy) -> str | None:
        plan = compile_dygraph(policy.replace(on_unsupported="fallback"), self._place())
        hidden = [n for n in plan.notes if n.startswith("fallback:")]
        if hidden:
            return ("Paddle cannot run " + "; ".join(h[len("fallback: "):] for h in hidden)
                    + " (a fallback the core's expectations cannot express; see CORE_REQUESTS.md)")
        return None

    def apply(self, policy: Policy, model: Any, optimizer: Any) -> Any:
        import unimp

        mode = "error" if self.supports(policy) else "fallback"
        return unimp.apply(policy.replace(on_unsupported=mode), model, optimizer, backend="paddle")

    def build_probe(self, weights: dict[str, Any]) -> Any:
        import paddle

        model = _probe_class()()
        w = dict(weights)
        w["conv.weight"] = np.ascontiguousarray(np.transpose(w["conv.weight"], (2, 1, 0)))
        state = model.state_dict()
        with paddle.no_grad():
            for k, v in w.items():
                state[k].set_value(paddle.to_tensor(v, dtype="float32"))
        return model

    def make_optimizer(self, model: Any, lr: float = 1e-2) -> Any:
        import paddle

        return paddle.optimizer.Adam(learning_rate=lr, parameters=model.parameters())

    def _tokens(self, batch: ProbeBatch) -> Any:
        import paddle

        return paddle.to_tensor(batch.tokens.astype(np.int64))

    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        return {path: Observation(obs["output"], obs["param"], obs["output"])
                for path, (_kind, obs) in amp.observe(self._tokens(batch)).items()}

    def output(self, amp: Any, batch: ProbeBatch) -> Any:
        return amp.model(self._tokens(batch))

    def dtype_name(self, value: Any) -> str:
        return dtype_name(value.dtype)

    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        import paddle

        logp = amp.model(self._tokens(batch)).astype("float32")
        targets = paddle.to_tensor(batch.targets.astype(np.int64)).unsqueeze(-1)
        loss = -paddle.take_along_axis(logp, targets, axis=-1).mean()
        value = float(loss.numpy())
        if poison:
            loss = loss * float("inf")
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.clear_grad()
        return value

    def snapshot(self, amp: Any) -> dict[str, Any]:
        out = {f"param/{k}": v.numpy().copy() for k, v in amp.model.state_dict().items()}
        for k, v in amp.optimizer.inner.state_dict().items():
            if hasattr(v, "numpy"):
                out[f"opt/{k}"] = v.numpy().copy()
        for k, v in getattr(amp.optimizer.inner, "_master_weights", {}).items():
            out[f"master/{k}"] = v.numpy().copy()
        return out

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        masters = getattr(amp.optimizer.inner, "_master_weights", {}) or {}
        out = []
        for name, p in amp.model.named_parameters():
            if p.name in masters:
                out.append((name, p.astype("float32").numpy(), masters[p.name].numpy()))
        return out

    def model_state(self, model: Any) -> dict[str, tuple[str, Any]]:
        return {k: (dtype_name(v.dtype), v.numpy().copy()) for k, v in model.state_dict().items()}

    def forward_fingerprint(self, model: Any, batch: ProbeBatch) -> Any:
        return model(self._tokens(batch)).numpy()
