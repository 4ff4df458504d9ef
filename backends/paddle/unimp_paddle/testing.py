"""The Paddle conformance kit (dygraph path): the shared probe as a ``paddle.nn.Layer``.

On CPU Paddle's dygraph AMP does nothing: a policy Paddle cannot run as written (anything low precision,
with the presets' ``on_unsupported = "error"``) is applied with ``on_unsupported = "fallback"``
(:meth:`PaddleKit.apply`), and the checks expect exactly the Plan's reported fallbacks (all ``float32`` on
CPU). On a GPU the kit applies every policy unchanged.

>>> from unimp.conformance.probe import probe_weights
>>> kit = PaddleKit()
>>> [name for name, _ in kit.build_probe(probe_weights()).named_children()]
['embed', 'fc1', 'act', 'conv', 'norm', 'head', 'logp']
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import CHANNELS, CLASSES, HIDDEN, KERNEL, LN_EPS, VOCAB, ProbeBatch
from unimp.spi import Plan, PlanRequest, UnsupportedError, dtypes

from .plan import compile_dygraph, default_place


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

    def supports(self, request: PlanRequest) -> str | None:
        """On CPU every request has an expressible fallback (see :meth:`apply`); on a GPU a policy
        Paddle cannot run as written is unsupported (its UnsupportedError is then checked)."""
        if default_place(load=True) == "cpu":
            return None
        try:
            compile_dygraph(request, "gpu")
        except UnsupportedError as e:
            return str(e)
        return None

    def apply(self, policy: Any, model: Any, optimizer: Any) -> Any:
        """``unimp.apply`` with the policy as written when Paddle can honour it here; on CPU, else,
        with ``on_unsupported = "fallback"`` (the same policy otherwise, so the Plan reports every
        fallback). The variant is visible as ``amp.policy.on_unsupported``."""
        from unimp.spi import apply

        if default_place(load=True) == "cpu":
            try:
                compile_dygraph(Plan.request(policy, "paddle"), "cpu")
            except UnsupportedError:  # only raised under on_unsupported = "error": the same policy, "fallback"
                policy = self.with_fallback(policy)
        return apply(policy, model, optimizer, backend="paddle")

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

    def make_sgd(self, model: Any, lr: float = 0.1) -> Any:
        import paddle

        return paddle.optimizer.SGD(learning_rate=lr, parameters=model.parameters())

    def _tokens(self, batch: ProbeBatch) -> Any:
        import paddle

        return paddle.to_tensor(batch.tokens.astype(np.int64))

    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        return {path: Observation(obs["output"], obs["param"], obs["output"])
                for path, (_kind, obs) in amp.observe(self._tokens(batch)).items()}

    def output(self, amp: Any, batch: ProbeBatch) -> Any:
        return amp.model(self._tokens(batch))

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
        for k, v in _masters(amp).items():
            out[f"master/{k}"] = v.numpy().copy()
        return out

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        masters = _masters(amp)
        return [(name, p.astype("float32").numpy(), masters[p.name].numpy())
                for name, p in amp.model.named_parameters() if p.name in masters]

    def export_weights(self, amp: Any) -> dict[str, Any]:
        """Current probe weights as float32 numpy in the probe layout (Linear ``(in, out)`` as Paddle
        stores it; Conv1D ``(out, in, width)`` back to ``(width, in, out)``), from the fp32 masters
        where Paddle keeps them (O2)."""
        masters = _masters(amp)
        out = {name: np.asarray(masters.get(p.name, p).astype("float32").numpy(), np.float32)
               for name, p in amp.model.named_parameters()}
        out["conv.weight"] = np.ascontiguousarray(np.transpose(out["conv.weight"], (2, 1, 0)))
        return out

    def model_state(self, model: Any) -> dict[str, tuple[str, Any]]:
        return {k: (dtypes.dtype_name(v.dtype), v.numpy().copy()) for k, v in model.state_dict().items()}

    def forward_fingerprint(self, model: Any, batch: ProbeBatch) -> Any:
        return model(self._tokens(batch)).numpy()


def _masters(amp: Any) -> dict[str, Any]:
    """The fp32 masters Paddle's optimizer keeps (O2), by parameter name."""
    return getattr(amp.optimizer.inner, "_master_weights", {}) or {}
