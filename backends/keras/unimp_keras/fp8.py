"""FP8 training through Keras' own float8 layers (``layer.quantize("float8")``), on the Dense layers the Plan chooses.

Keras' one recipe, delayed scaling from an amax history, is the Plan's ``recipe = "delayed"``; its scaling state
(six float32 model weights per layer) is ``amp.state_dict()["fp8"]`` under unimp's names (``fc1.input_scale``).
Keras' float8 gradient does not run eagerly on TensorFlow (a clear ``UnsupportedError``); ``remove()`` restores
the layer exactly.

>>> import keras, unimp
>>> m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="fc")])
>>> amp = unimp.apply("keras_float8", m, keras.optimizers.SGD(0.1))
>>> m.get_layer("fc").quantization_mode, int(m.get_layer("fc").inputs_amax_history.shape[0])
('float8', 1024)
>>> _ = amp.remove(); m.get_layer("fc").quantization_mode is None, len(m.get_layer("fc").weights)
(True, 2)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from unimp.spi import Fp8Decision, Fp8Support, Plan, UnsupportedError

KERAS_RECIPE = "delayed"
# Keras' variable names -> the names every unimp backend uses in state_dict()["fp8"] (Flax's)
NAMES = {"inputs_scale": "input_scale", "inputs_amax_history": "input_amax_history",
         "kernel_scale": "kernel_scale", "kernel_amax_history": "kernel_amax_history",
         "outputs_grad_scale": "output_grad_scale", "outputs_grad_amax_history": "output_grad_amax_history"}
_MISSING = object()
QUANTIZABLE = ("Dense",)  # Keras' Dense.quantize refuses subclasses (type_check)


def support() -> Fp8Support:
    """What this backend runs in FP8: Keras' float8 Dense training (delayed scaling, e5m2 gradients)."""
    why = "Keras 3 float8 training has one recipe, delayed scaling from an amax history (recipe = 'delayed')"
    return Fp8Support(
        ops=("linear",), recipes={KERAS_RECIPE: "Keras layer.quantize('float8') (QuantizedFloat8DTypePolicy)"},
        gradient_formats=("e5m2",),
        why_not={r: why for r in ("tensorwise", "rowwise", "rowwise_gw_hp")},
        notes=("Keras float8 runs quantize-dequantize around the matmul in the compute dtype (TensorFlow has "
               "no FP8 GEMM); the scaling state is six model weights per FP8 layer",))


@dataclass
class Fp8Layer:
    """One Dense layer unimp quantized, with what ``undo`` puts back."""

    path: str
    layer: Any
    was_quantized: Any
    config: Any


def _dims(layer: Any) -> dict[str, int] | None:
    kernel = getattr(layer, "_kernel", None)
    shape = tuple(getattr(kernel, "shape", ()))
    return {"in_features": int(shape[0]), "out_features": int(shape[1])} if len(shape) == 2 else None


def decide(plan: Plan, units: list[Any]) -> list[tuple[Any, Fp8Decision]]:
    """The core's decision for every unit FP8 could concern (Keras-specific limits folded in)."""
    out = []
    for u in units:
        if u.container or not plan.asks_fp8(u.path, u.kind, u.type_names):
            continue
        d = plan.decide_fp8(u.path, u.kind, u.type_names, _dims(u.layer) or {})
        if d.fp8 and (type(u.layer).__name__ not in QUANTIZABLE or _dims(u.layer) is None):
            d = Fp8Decision(u.path, False, None, f"{type(u.layer).__name__}: Keras float8 training covers "
                                                 f"keras.layers.Dense only (stays in the compute dtype)")
        out.append((u, d))
    return out


EAGER = ("unimp (keras): layer {path!r} trains in Keras float8, whose custom gradient does not run "
         "eagerly on TensorFlow (under an eager tf.GradientTape Keras fails inside it); fix: train with "
         "model.fit / model.train_on_batch (not run_eagerly), or wrap your training step in tf.function")


def guard_eager(u: Any) -> Any:
    """TensorFlow: the float8 layer's ``quantized_call`` raising a clear :class:`UnsupportedError` instead of
    Keras' internal error when it is differentiated eagerly."""
    import tensorflow as tf
    from tensorflow.python.eager import record

    original = u.layer.quantized_call

    def quantized_call(*args: Any, **kwargs: Any) -> Any:
        if tf.executing_eagerly() and record.could_possibly_record():
            raise UnsupportedError(EAGER.format(path=u.path))
        return original(*args, **kwargs)

    return quantized_call


def quantize(plan: Plan, u: Any, originals: dict[int, tuple[Any, Any]]) -> Fp8Layer:
    """``layer.quantize("float8")`` under the Plan's amax history (its dtype policy remembered in ``originals``)."""
    from keras.dtype_policies import QuantizedFloat8DTypePolicy

    assert plan.fp8 is not None  # a layer the Plan's fp8 table chose
    layer = u.layer
    entry = Fp8Layer(u.path, layer, layer.__dict__.get("_is_quantized", _MISSING),
                     layer.__dict__.get("quantization_config", _MISSING))
    originals.setdefault(id(layer), (layer, layer._dtype_policy))
    source = layer._dtype_policy.name
    layer._dtype_policy = QuantizedFloat8DTypePolicy("float8", source_name=source,
                                                     amax_history_length=plan.fp8.amax_history)
    layer.quantize("float8")
    return entry


def undo(entries: list[Fp8Layer]) -> None:
    """Delete the scaling weights and the quantized state (the policy is restored with the binding's)."""
    for e in reversed(entries):
        for name in NAMES:
            if name in e.layer.__dict__:
                delattr(e.layer, name)  # Keras untracks the variable
        for attr, value in (("_is_quantized", e.was_quantized), ("quantization_config", e.config)):
            if value is _MISSING:
                e.layer.__dict__.pop(attr, None)
            else:
                object.__setattr__(e.layer, attr, value)


def state(entries: list[Fp8Layer]) -> dict[str, list[float]]:
    """``{"path.input_scale": [floats], ...}``: the scaling weights as plain float32 values."""
    out = {}
    for e in entries:
        for keras_name, name in sorted(NAMES.items(), key=lambda kv: kv[1]):
            v = np.asarray(getattr(e.layer, keras_name).numpy(), np.float32).ravel()
            out[f"{e.path}.{name}"] = [float(x) for x in v]
    return out


def load(entries: list[Fp8Layer], plain: Mapping[str, Any]) -> None:
    """Assign ``plain`` (checked by :func:`check`) to the scaling weights, exactly."""
    for e in entries:
        for keras_name, name in NAMES.items():
            var = getattr(e.layer, keras_name)
            var.assign(np.asarray(plain[f"{e.path}.{name}"], np.float32).reshape(var.shape))
