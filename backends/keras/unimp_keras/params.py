"""Low-precision parameters on an existing Keras layer: bf16 copies swapped in (Keras fixes a variable's dtype at
creation), the float32 originals the optimizer's masters; :meth:`Swap.undo` puts the originals back.

>>> import keras
>>> d = keras.layers.Dense(2); d.build((None, 3))
>>> swaps = swap_params(d, "bfloat16")
>>> d.kernel.dtype, swaps[0].original.dtype
('bfloat16', 'float32')
>>> for s in swaps: s.undo(write_back=False)
>>> d.kernel.dtype
'float32'
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import keras
from keras import ops


@dataclass
class Swap:
    """One variable replaced on one layer: where it lives and both versions."""

    layer: Any
    attrs: tuple[str, ...]
    store: str  # "_trainable_variables" | "_non_trainable_variables"
    original: Any
    low: Any
    initial: Any  # the low copy's value when swapped in

    def undo(self, write_back: bool) -> None:
        """Put the original back; ``write_back`` copies the low values into it if they changed."""
        changed = not bool(ops.convert_to_numpy(ops.all(ops.equal(self.low.value, self.initial))))
        if write_back and changed:
            self.original.assign(ops.cast(self.low.value, self.original.dtype))
        _replace(self.layer, self.attrs, self.store, self.low, self.original)


def _replace(layer: Any, attrs: tuple[str, ...], store: str, old: Any, new: Any) -> None:
    for a in attrs:
        object.__setattr__(layer, a, new)
    items = getattr(layer, store)
    items[next(i for i, v in enumerate(items) if v is old)] = new


def retrack(model: Any, pairs: list[tuple[Any, Any]]) -> None:
    """Keras' torch backend: the model's ``_torch_params`` pointed at ``new``'s tensor for each ``(old, new)`` pair,
    so ``parameters()`` and ``zero_grad()`` see the variables that run (else gradients add up over the steps)."""
    if keras.backend.backend() != "torch" or not pairs:
        return
    import torch

    by_id = {id(old.value): new.value for old, new in pairs}
    for module in model.modules():
        if isinstance(module, torch.nn.ParameterDict):
            for key, tensor in list(module.items()):
                if id(tensor) in by_id:
                    module[key] = by_id[id(tensor)]


def _same_path(var: Any, value: Any, dtype: str) -> Any:
    """A new variable at ``var``'s path (``model/layer/kernel``: Keras keys a torch model's parameters by path)."""
    with contextlib.ExitStack() as scopes:
        for part in var.path.split("/")[:-1]:
            scopes.enter_context(keras.name_scope(part))
        return keras.Variable(value, dtype=dtype, trainable=var.trainable, name=var.name)


def swap_params(layer: Any, dtype: str) -> list[Swap]:
    """Replace the layer's own float variables by ``dtype`` copies; returns what to undo."""
    swaps = []
    for store in ("_trainable_variables", "_non_trainable_variables"):
        for var in list(getattr(layer, store, [])):
            if var.dtype == dtype or not keras.backend.is_float_dtype(var.dtype):
                continue
            attrs = tuple(k for k, v in vars(layer).items() if v is var)
            low = _same_path(var, ops.cast(var.value, dtype), dtype)
            _replace(layer, attrs, store, var, low)
            swaps.append(Swap(layer, attrs, store, var, low, ops.copy(low.value)))
    return swaps
