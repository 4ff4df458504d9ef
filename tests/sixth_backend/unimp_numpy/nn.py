"""A tiny NumPy layer library (the "framework" of the sixth backend): forward in a chosen dtype,
backward by hand in float32, Adam and SGD.

Each layer computes in ``layer.dtype`` when set (unimp sets it), else in its input's dtype; its
params stay float32. With ``model.tracing`` on, each call keeps ``(path, compute, param, output)``
dtype names per layer in ``model.last_trace``.

>>> import numpy as np
>>> m = Model([("fc", Linear(np.eye(2, dtype=np.float32), np.zeros(2, np.float32)))])
>>> m(np.ones((1, 2), np.float32)).dtype.name
'float32'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

LN_EPS = 1e-5


class Layer:
    """A layer: float32 ``params``, ``grads`` after :meth:`backward`, and the dtype rule unimp sets."""

    dims: tuple[str, ...] = ()

    def __init__(self, **params: np.ndarray) -> None:
        self.params = {k: np.asarray(v, np.float32) for k, v in params.items()}
        self.grads: dict[str, np.ndarray] = {}
        self.rule: Callable[[str | None, str | None], str | None] | None = None  # (input, param) -> dtype

    def dtype_for(self, x: np.ndarray) -> str:
        param = next((p.dtype.name for p in self.params.values()), None)
        x_dtype = x.dtype.name if x.dtype.kind == "f" else None
        chosen = self.rule(x_dtype, param) if self.rule else None
        return chosen or x_dtype or param or "float32"

    def dim_values(self) -> tuple[tuple[str, int], ...]:
        return ()

    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        raise NotImplementedError

    def backward(self, g: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Embedding(Layer):
    def __init__(self, weight: np.ndarray) -> None:
        super().__init__(weight=weight)

    def dim_values(self) -> tuple[tuple[str, int], ...]:
        v, c = self.params["weight"].shape
        return (("num_embeddings", v), ("embedding_dim", c))

    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        self._tokens = x
        return self.params["weight"].astype(dt)[x]

    def backward(self, g: np.ndarray) -> np.ndarray:
        dw = np.zeros_like(self.params["weight"])
        np.add.at(dw, self._tokens, g)
        self.grads = {"weight": dw}
        return np.zeros(())


class Linear(Layer):
    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        super().__init__(weight=weight, bias=bias)

    def dim_values(self) -> tuple[tuple[str, int], ...]:
        i, o = self.params["weight"].shape
        return (("in_features", i), ("out_features", o))

    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        x = x.astype(dt)
        self._x = x.astype(np.float32)
        return x @ self.params["weight"].astype(dt) + self.params["bias"].astype(dt)

    def backward(self, g: np.ndarray) -> np.ndarray:
        w = self.params["weight"]
        self.grads = {"weight": self._x.reshape(-1, w.shape[0]).T @ g.reshape(-1, w.shape[1]),
                      "bias": g.reshape(-1, w.shape[1]).sum(0)}
        return g @ w.T


class ReLU(Layer):
    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        x = x.astype(dt)
        self._mask = x > 0
        return np.maximum(x, np.zeros((), dt))

    def backward(self, g: np.ndarray) -> np.ndarray:
        return g * self._mask


class Conv1d(Layer):
    """'same' convolution over time of ``(batch, time, channels)``; kernel ``(width, in, out)``."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        super().__init__(weight=weight, bias=bias)

    def dim_values(self) -> tuple[tuple[str, int], ...]:
        _, i, o = self.params["weight"].shape
        return (("in_channels", i), ("out_channels", o))

    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        w, k = self.params["weight"].astype(dt), self.params["weight"].shape[0]
        t = x.shape[1]
        xp = np.pad(x.astype(dt), ((0, 0), (k // 2, k // 2), (0, 0)))
        self._xp = xp.astype(np.float32)
        return sum(xp[:, j:j + t] @ w[j] for j in range(k)) + self.params["bias"].astype(dt)

    def backward(self, g: np.ndarray) -> np.ndarray:
        w, k = self.params["weight"], self.params["weight"].shape[0]
        t, c_in, c_out = g.shape[1], w.shape[1], w.shape[2]
        dxp = np.zeros_like(self._xp)
        dw = np.zeros_like(w)
        for j in range(k):
            dw[j] = self._xp[:, j:j + t].reshape(-1, c_in).T @ g.reshape(-1, c_out)
            dxp[:, j:j + t] += g @ w[j].T
        self.grads = {"weight": dw, "bias": g.reshape(-1, c_out).sum(0)}
        return dxp[:, k // 2:k // 2 + t]


class LayerNorm(Layer):
    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        super().__init__(weight=weight, bias=bias)

    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        x = x.astype(dt)
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        xhat = (x - mu) / np.sqrt(var + np.asarray(LN_EPS, dt))
        self._xhat, self._inv = xhat.astype(np.float32), (1 / np.sqrt(var + LN_EPS)).astype(np.float32)
        return xhat * self.params["weight"].astype(dt) + self.params["bias"].astype(dt)

    def backward(self, g: np.ndarray) -> np.ndarray:
        xhat, n = self._xhat, g.shape[-1]
        self.grads = {"weight": (g * xhat).reshape(-1, n).sum(0), "bias": g.reshape(-1, n).sum(0)}
        dx = g * self.params["weight"]
        return self._inv / n * (n * dx - dx.sum(-1, keepdims=True) - xhat * (dx * xhat).sum(-1, keepdims=True))


class LogSoftmax(Layer):
    def forward(self, x: np.ndarray, dt: str) -> np.ndarray:
        z = x.astype(dt)
        z = z - z.max(-1, keepdims=True)
        out = z - np.log(np.exp(z).sum(-1, keepdims=True))
        self._p = np.exp(out.astype(np.float32))
        return out

    def backward(self, g: np.ndarray) -> np.ndarray:
        return g - self._p * g.sum(-1, keepdims=True)


class Model:
    """Layers run in order; ``output_dtype`` (set by unimp; None = not cast) casts the output."""

    def __init__(self, layers: list[tuple[str, Layer]]) -> None:
        self.layers = list(layers)
        self.output_dtype: str | None = None
        self.tracing = False
        self.last_trace: list[tuple[str, str, str | None, str]] | None = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        trace = []
        for path, layer in self.layers:
            dt = layer.dtype_for(x)
            x = layer.forward(x, dt)
            trace.append((path, dt, next((p.dtype.name for p in layer.params.values()), None), x.dtype.name))
        if self.tracing:
            self.last_trace = trace
        return x.astype(self.output_dtype) if self.output_dtype else x

    def backward(self, g: np.ndarray) -> None:
        """Gradients of every param for the output gradient ``g`` (computed in float32)."""
        g = np.asarray(g, np.float32)
        for _, layer in reversed(self.layers):
            g = layer.backward(g)

    def named_params(self) -> dict[str, np.ndarray]:
        return {f"{path}.{k}": v for path, layer in self.layers for k, v in layer.params.items()}

    def named_grads(self) -> dict[str, np.ndarray]:
        return {f"{path}.{k}": v for path, layer in self.layers for k, v in layer.grads.items()}


class SGD:
    def __init__(self, model: Model, lr: float = 0.1) -> None:
        self.model, self.lr = model, lr
        self.state: dict[str, Any] = {}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        params = self.model.named_params()
        for k, g in grads.items():
            params[k] -= np.float32(self.lr) * g


class Adam(SGD):
    def __init__(self, model: Model, lr: float = 1e-2, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
        super().__init__(model, lr)
        self.b1, self.b2, self.eps, self.t = b1, b2, eps, 0

    def step(self, grads: dict[str, np.ndarray]) -> None:
        self.t += 1
        params = self.model.named_params()
        for k, g in grads.items():
            m = self.state.setdefault(f"{k}.m", np.zeros_like(g))
            v = self.state.setdefault(f"{k}.v", np.zeros_like(g))
            m[...] = self.b1 * m + (1 - self.b1) * g
            v[...] = self.b2 * v + (1 - self.b2) * g * g
            mhat, vhat = m / (1 - self.b1 ** self.t), v / (1 - self.b2 ** self.t)
            params[k] -= (self.lr * mhat / (np.sqrt(vhat) + self.eps)).astype(np.float32)
