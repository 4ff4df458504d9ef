"""Walk a Keras model: every layer the policy decides, with its dotted path (``block1.dense``: policy globs
read as for torch) and canonical kind. A layer whose class maps to a canonical op is one *unit* (its sublayers
get its dtype); other containers are walked into, a *composite* one (``COMPOSITE_KINDS``: keras_hub's
``CachedGemmaAttention``) carrying the op its own code runs.

>>> import keras
>>> m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc"),
...                       keras.layers.Activation("softmax", name="prob")])
>>> [(u.path, u.kind) for u in walk(m)]
[('fc', 'linear'), ('prob', 'softmax')]
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
from keras.src.models.functional import Functional

from unimp.spi import LayerInfo, ops

from .ops import NATIVE_OPS

# Activation functions that are canonical ops of their own (Activation("log_softmax")).
ACTIVATION_KINDS = {"softmax": "softmax", "log_softmax": "log_softmax"}
# Composite layers (sublayers of their own, no canonical class) by class-name suffix: the op their
# own code runs between the sublayers (keras_hub: CachedGemmaAttention, LlamaAttention, ...).
COMPOSITE_KINDS = (("Attention", "attention"),)


@dataclass(frozen=True)
class Unit:
    """One layer the policy decides: path, the layer, canonical kind, native class names."""

    path: str
    layer: Any
    kind: str | None
    type_names: tuple[str, ...]
    container: bool = False  # walked into; its own dtype follows its inputs
    parent: Any = None  # the enclosing container layer (None: a direct child of the model)

    @property
    def has_params(self) -> bool:
        return bool(self.layer.weights)


def type_names(layer: Any) -> tuple[str, ...]:
    """The layer's class and its Keras base classes, most specific first (``Dense`` subclasses match)."""
    return ops.class_names(type(layer), stop=(keras.layers.Layer, keras.Model))


def kind_of_layer(layer: Any) -> str | None:
    """The canonical op a Keras layer performs (``None``: no canonical kind, follows its inputs)."""
    if isinstance(layer, keras.layers.Activation):
        fn = getattr(layer.activation, "__name__", "")
        return ACTIVATION_KINDS.get(fn, "activation")
    return ops.kind_of_names(type_names(layer), NATIVE_OPS)


def composite_kind(names: tuple[str, ...]) -> str | None:
    """The op a composite layer's own code runs, from its class names (most specific first).

    >>> composite_kind(("CachedGemmaAttention",)), composite_kind(("TransformerDecoder",))
    ('attention', None)
    """
    for name in names:
        for suffix, kind in COMPOSITE_KINDS:
            if name.endswith(suffix):
                return kind
    return None


def sublayers(layer: Any) -> list[Any]:
    """Direct sublayers, without Keras InputLayers."""
    return [s for s in layer._flatten_layers(include_self=False, recursive=False)
            if not isinstance(s, keras.layers.InputLayer)]


def walk(model: Any) -> list[Unit]:
    """Units and containers of ``model`` (not the model itself), depth-first in build order."""
    return list(_walk(model, ""))


def _walk(layer: Any, prefix: str, parent: Any = None) -> Iterator[Unit]:
    for sub in sublayers(layer):
        path = f"{prefix}.{sub.name}" if prefix else sub.name
        kind = kind_of_layer(sub)
        children = sublayers(sub)
        if kind is None and children:
            names = type_names(sub)
            yield Unit(path, sub, composite_kind(names), names, container=True, parent=parent)
            yield from _walk(sub, path, sub)
        else:
            yield Unit(path, sub, kind, type_names(sub), parent=parent)


def dims(layer: Any) -> tuple[tuple[str, int], ...]:
    """The dims of a layer that matter for tensor-core tiling, with Keras' names."""
    if hasattr(layer, "embeddings") and getattr(layer, "input_dim", None) is not None:
        return (("input_dim", int(layer.input_dim)), ("output_dim", int(layer.output_dim)))
    kernel = getattr(layer, "kernel", None) if getattr(layer, "built", False) else None
    if kernel is None or len(kernel.shape) < 2:
        return ()
    out_name = "filters" if hasattr(layer, "filters") else "units"
    return (("input_dim" if out_name == "units" else "input_channels", int(kernel.shape[-2])),
            (out_name, int(kernel.shape[-1])))


def model_index(model: Any) -> tuple[LayerInfo, ...]:
    """The Plan's index of ``model``: per unit its path, kind, class names and (leaf units) tiling dims."""
    return tuple(LayerInfo(u.path, u.kind, u.type_names, () if u.container else dims(u.layer)) for u in walk(model))


def is_graph(layer: Any) -> bool:
    """Whether ``layer`` is a Sequential/functional model, whose sublayers are joined by layers only (a subclassed
    container may join them with raw ops, ``x + residual``)."""
    return isinstance(layer, (Functional, keras.Sequential))


def descendants(layer: Any) -> list[Any]:
    """Every layer inside ``layer`` (recursively), for units whose sublayers share its dtype."""
    return layer._flatten_layers(include_self=False, recursive=True)
