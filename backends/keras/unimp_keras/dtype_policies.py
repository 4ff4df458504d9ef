"""Keras dtype policies for unimp's layer decisions: a fixed one is a Keras ``DTypePolicy`` (``mixed_bfloat16``); a
layer following its inputs gets :class:`FollowInputs` (the arriving activation's dtype; promote: the widest of it
and the variables). ``model.save`` writes each layer's original policy: the file loads without unimp.

>>> keras_policy("bfloat16", "float32").name
'mixed_bfloat16'
>>> keras_policy("float32", "bfloat16").compute_dtype
'float32'
>>> FollowInputs("float32").compute_dtype
'float32'
"""

from __future__ import annotations

import copy
from typing import Any

import keras
from keras import backend as K

from unimp.spi import dtypes


class Applied(keras.DTypePolicy):
    """A policy unimp set on a layer; it saves as the layer's original policy (``saved``)."""

    saved: dict[str, Any] | None = None  # the original policy's config, set when applied to a layer

    def get_config(self) -> dict[str, Any]:
        return dict(self.saved) if self.saved is not None else {"name": self.variable_dtype}

    def for_layer(self, original: Any) -> Applied:
        """A copy of this policy for one layer, saving as that layer's ``original`` policy."""
        mine = copy.copy(self)
        mine.saved = original.get_config() if type(original) is keras.DTypePolicy else None
        return mine


def keras_policy(compute: str, param: str) -> Applied:
    """The Keras policy computing in ``compute`` over variables in ``param``."""
    if compute == param:
        return Applied(compute)
    if param == "float32" and compute in ("float16", "bfloat16"):
        return Applied(f"mixed_{compute}")
    return Explicit(compute, param)


class Explicit(Applied):
    """Any compute dtype over any variable dtype (Keras' names only cover ``mixed_<low>`` over fp32); Keras'
    ``AutocastScope`` casts float variables to the compute dtype in both directions."""

    def __init__(self, compute: str, variable: str) -> None:
        super().__init__(variable)
        self._compute_dtype = compute

    def __repr__(self) -> str:
        return f"<Explicit compute={self.compute_dtype} variables={self.variable_dtype}>"


class FollowInputs(Applied):
    """Compute in the incoming activation's dtype (``promote``: widest of it and the variables)."""

    def __init__(self, param_dtype: str = "float32", promote: bool = False) -> None:
        super().__init__(param_dtype)
        self._promote = promote
        self._seen = param_dtype  # integer inputs (embedding lookups): the variables' dtype

    @property
    def compute_dtype(self) -> str:
        return self._seen

    def convert_input(self, x: Any, autocast: bool, dtype: Any) -> Any:
        if not (keras.ops.is_tensor(x) or K.is_keras_tensor(x)):
            if not hasattr(x, "__array__"):
                return x
            x = keras.ops.convert_to_tensor(x)
        x_dtype = K.standardize_dtype(x.dtype)
        if not K.is_float_dtype(x_dtype):
            return x
        target = (dtypes.widest([x_dtype, self.variable_dtype]) or x_dtype) if self._promote else x_dtype
        self._seen = target
        return x if target == x_dtype else keras.ops.cast(x, target)

    def __repr__(self) -> str:
        return f"<FollowInputs variables={self.variable_dtype} promote={self._promote}>"


def _save_as_keras_policy() -> None:
    """Serialize unimp's policies under Keras' public name ``keras.DTypePolicy`` (their config is one), not their
    module, which a loader without unimp could not import."""
    from keras.src import api_export

    for cls in (Applied, Explicit, FollowInputs):
        api_export.REGISTERED_OBJS_TO_NAMES.setdefault(cls, "keras.DTypePolicy")


_save_as_keras_policy()
