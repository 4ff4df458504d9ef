"""The conformance kit: the shared probe as a Keras functional model, driven by a custom loop.

>>> from unimp.conformance.probe import probe_weights
>>> kit = KerasKit()
>>> m = kit.build_probe(probe_weights())
>>> [layer.name for layer in m.layers[1:]]
['embed', 'fc1', 'act', 'conv', 'norm', 'head', 'logp']
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import CHANNELS, CLASSES, HIDDEN, KERNEL, LN_EPS, PROBE, TIME, VOCAB, ProbeBatch

from .index import walk
from .steps import custom_step
from .trace import restore, set_method


def built_under(policy: str, factory: Any, x: Any = None, seed: int = 0) -> Any:
    """``factory()`` built as a Keras user builds it under ``keras.config.set_dtype_policy(policy)``: seeded (the
    same initial weights every call), called once on ``x`` when given; Keras' global policy put back after.

    >>> built_under("mixed_float16", lambda: keras.layers.Dense(2)).compute_dtype
    'float16'
    """
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(seed)
        model = factory()
        if x is not None:
            model(x)
        return model
    finally:
        keras.config.set_dtype_policy(old)


def output_dtypes(model: Any, layers: Any, x: Any) -> tuple[list[tuple[Any, str | None]], Any]:
    """``model(x)`` with each of ``layers``' output dtype recorded (by wrapping its ``call`` on the instance for
    this one call, not through unimp): ``([(layer, dtype of its first tensor result), ...] in call order, out)``.

    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, dtype="mixed_float16", name="fc")])
    >>> [(layer.name, d) for layer, d in output_dtypes(m, m.layers, np.ones((1, 2)))[0]]
    [('fc', 'float16')]
    """
    seen: list[tuple[Any, str | None]] = []
    saved: list[tuple[Any, Any, str]] = []
    for layer in layers:
        inner = layer.call

        def record(*a: Any, _layer: Any = layer, _call: Any = inner, **k: Any) -> Any:
            out = _call(*a, **k)
            leaves = [t for t in keras.tree.flatten(out) if hasattr(t, "dtype")]
            seen.append((_layer, keras.backend.standardize_dtype(leaves[0].dtype) if leaves else None))
            return out

        set_method(layer, "call", record, saved)
    try:
        out = model(x)
    finally:
        for layer, own, name in reversed(saved):
            restore(layer, own, name)
    return seen, out


def nll(logp: Any, targets: Any) -> Any:
    """Mean negative log-likelihood of integer targets, in float32."""
    index = ops.expand_dims(ops.cast(targets, "int32"), -1)
    return -ops.mean(ops.take_along_axis(ops.cast(logp, "float32"), index, axis=-1))


_PROBE_PARAM = {"embeddings": "weight", "kernel": "weight", "gamma": "weight", "bias": "bias", "beta": "bias"}


class KerasKit(Kit):
    """Hooks for :mod:`unimp.conformance` on Keras 3, this process' Keras backend."""

    backend = "keras"

    @property
    def label(self) -> str:
        """``keras-<Keras backend>``: one conformance column per Keras backend (``.obs/keras-jax.json``)."""
        return f"keras-{keras.backend.backend()}"

    def build_probe(self, weights: dict[str, Any]) -> Any:
        ly = keras.layers
        inp = keras.Input((TIME,), dtype="int32")
        x = ly.Embedding(VOCAB, CHANNELS, name="embed", dtype="float32")(inp)
        x = ly.Dense(HIDDEN, name="fc1", dtype="float32")(x)
        x = ly.ReLU(name="act", dtype="float32")(x)
        x = ly.Conv1D(CHANNELS, KERNEL, padding="same", name="conv", dtype="float32")(x)
        x = ly.LayerNormalization(epsilon=LN_EPS, name="norm", dtype="float32")(x)
        x = ly.Dense(CLASSES, name="head", dtype="float32")(x)
        out = ly.Activation("log_softmax", name="logp", dtype="float32")(x)
        model = keras.Model(inp, out, name="probe")
        w = weights
        model.get_layer("embed").set_weights([w["embed.weight"]])
        for name in ("fc1", "conv", "norm", "head"):
            model.get_layer(name).set_weights([w[f"{name}.weight"], w[f"{name}.bias"]])
        return model

    def make_optimizer(self, model: Any, lr: float = 1e-2) -> Any:
        return keras.optimizers.Adam(lr)

    def make_sgd(self, model: Any, lr: float = 0.1) -> Any:
        return keras.optimizers.SGD(lr)

    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        return {path: o for path, o in self.observations(amp.report(batch.tokens)).items() if path}

    def output(self, amp: Any, batch: ProbeBatch) -> Any:
        return amp.model(batch.tokens, training=False)

    def dtype_name(self, value: Any) -> str:
        return keras.backend.standardize_dtype(value.dtype)

    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        """One custom-loop step, each Keras backend's own way (:func:`custom_step`)."""
        return custom_step(amp, nll, batch.tokens, batch.targets, poison)

    def snapshot(self, amp: Any) -> dict[str, Any]:
        out = {f"model/{i}:{v.path}": v.numpy() for i, v in enumerate(amp.model.weights)}
        inner = getattr(amp, "inner_optimizer", None)
        if inner is not None:
            out.update({f"optimizer/{i}:{v.path}": v.numpy() for i, v in enumerate(inner.variables)})
        for name, _, master in amp.master_pairs():
            out[f"master/{name}"] = master
        return out

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        return amp.master_pairs()

    def export_weights(self, amp: Any) -> dict[str, Any]:
        masters = {name: master for name, _, master in amp.master_pairs()}
        out = {}
        for layer in PROBE:
            for w in amp.model.get_layer(layer.path).weights:
                short = w.path.split("/")[-1]
                value = masters.get(f"{layer.path}.{short}", w.numpy())
                out[f"{layer.path}.{_PROBE_PARAM[short]}"] = np.asarray(value, np.float32)
        return out

    def model_state(self, model: Any) -> dict[str, tuple[str, Any]]:
        out = {f"{i}:{w.path}": (w.dtype, w.numpy()) for i, w in enumerate(model.weights)}
        for u in walk(model):
            out[f"policy:{u.path}"] = (f"{u.layer._dtype_policy!r} #{id(u.layer._dtype_policy)}", np.zeros(0))
        out["call"] = ("instance call" if "call" in vars(model) else "class call", np.zeros(0))
        return out

    def forward_fingerprint(self, model: Any, batch: ProbeBatch) -> Any:
        return ops.convert_to_numpy(model(batch.tokens, training=False))
