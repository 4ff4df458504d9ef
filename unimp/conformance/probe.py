"""The shared probe model: one framework-neutral architecture, weights and data as numpy.

Every kit builds exactly this model from :func:`probe_weights` so that the same policy, weights
and data can be compared across frameworks. Activations are ``(batch, time, channels)``;
Linear weights are ``(in, out)`` (``y = x @ W + b``); the conv kernel is ``(width, in, out)``
with 'same' padding over time.

>>> [layer.path for layer in PROBE]
['embed', 'fc1', 'act', 'conv', 'norm', 'head', 'logp']
>>> probe_weights()["fc1.weight"].shape
(16, 32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BATCH, TIME, VOCAB, CHANNELS, HIDDEN, CLASSES, KERNEL = 4, 8, 32, 16, 32, 8, 3
LN_EPS = 1e-5


@dataclass(frozen=True)
class ProbeLayer:
    path: str
    kind: str
    params: tuple[tuple[str, tuple[int, ...]], ...] = ()


PROBE: tuple[ProbeLayer, ...] = (
    ProbeLayer("embed", "embedding", (("weight", (VOCAB, CHANNELS)),)),
    ProbeLayer("fc1", "linear", (("weight", (CHANNELS, HIDDEN)), ("bias", (HIDDEN,)))),
    ProbeLayer("act", "activation"),  # relu
    ProbeLayer("conv", "conv", (("weight", (KERNEL, HIDDEN, CHANNELS)), ("bias", (CHANNELS,)))),
    ProbeLayer("norm", "layer_norm", (("weight", (CHANNELS,)), ("bias", (CHANNELS,)))),
    ProbeLayer("head", "linear", (("weight", (CHANNELS, CLASSES)), ("bias", (CLASSES,)))),
    ProbeLayer("logp", "log_softmax"),  # over the last axis
)
LAYERS = {layer.path: layer for layer in PROBE}


@dataclass(frozen=True)
class ProbeBatch:
    """``tokens`` int32 (BATCH, TIME); ``targets`` int32 (BATCH, TIME) in [0, CLASSES)."""

    tokens: Any
    targets: Any


def probe_weights(seed: int = 0) -> dict[str, Any]:
    """float32 numpy weights, ``"<layer>.<param>"`` -> array (LayerNorm: weight=1, bias=0)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {}
    for layer in PROBE:
        for name, shape in layer.params:
            if layer.kind == "layer_norm":
                value = np.ones(shape) if name == "weight" else np.zeros(shape)
            else:
                fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]
                value = rng.normal(0.0, 1.0 / np.sqrt(fan_in), size=shape)
            out[f"{layer.path}.{name}"] = value.astype(np.float32)
    return out


def probe_batches(n: int, seed: int = 1) -> list[ProbeBatch]:
    """``n`` batches of a learnable synthetic task (target = token mod CLASSES)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, VOCAB, size=(BATCH, TIME)).astype(np.int32)
        out.append(ProbeBatch(tokens, (tokens % CLASSES).astype(np.int32)))
    return out


def reference_forward(weights: dict[str, Any], batch: ProbeBatch) -> Any:
    """The probe in float32 numpy (log-probabilities), the ground truth every kit matches."""
    import numpy as np

    w = weights
    x = w["embed.weight"][batch.tokens]
    x = np.maximum(x @ w["fc1.weight"] + w["fc1.bias"], 0.0)
    pad = np.pad(x, ((0, 0), (KERNEL // 2, KERNEL // 2), (0, 0)))
    x = sum(pad[:, k:k + TIME] @ w["conv.weight"][k] for k in range(KERNEL)) + w["conv.bias"]
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    x = (x - mu) / np.sqrt(var + LN_EPS) * w["norm.weight"] + w["norm.bias"]
    z = x @ w["head.weight"] + w["head.bias"]
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def reference_loss(logp: Any, batch: ProbeBatch) -> float:
    """Mean negative log-likelihood of the targets (computed in float32 outside the model)."""
    import numpy as np

    picked = np.take_along_axis(np.asarray(logp, np.float32), batch.targets[..., None], -1)
    return float(-picked.mean())
