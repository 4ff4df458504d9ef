"""Build a Keras model under a policy: ``with unimp.scope(policy) as s:`` sets Keras' global dtype policy and
``image_data_format`` per the Plan, ``s.apply(model, optimizer)`` binds the rest; leaving restores Keras' globals.

>>> import keras, unimp
>>> with unimp.scope("mixed_bf16") as s:
...     m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="fc")])
...     keras.config.dtype_policy().name
'mixed_bfloat16'
>>> amp = s.apply(m, keras.optimizers.SGD(0.1)); _ = amp.remove()
>>> keras.config.dtype_policy().name
'float32'
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras

from unimp.spi import Plan, apply, dtypes


@dataclass(frozen=True)
class Scope:
    """The Plan a model is being built under."""

    plan: Plan
    keras_policy: str
    data_format: str
    backend: Any  # the KerasBackend that binds it

    def apply(self, model: Any, optimizer: Any = None, **options: Any) -> Any:
        """``unimp.apply(policy, model, optimizer)`` with the scope's Plan, all or nothing."""
        return apply(self.plan, model, optimizer, **options)


def global_policy_name(plan: Plan) -> str:
    """The Keras global policy for building under ``plan``."""
    if not dtypes.is_low(plan.compute_dtype):
        return "float32"
    return plan.compute_dtype if plan.param_dtype == plan.compute_dtype else f"mixed_{plan.compute_dtype}"


@contextmanager
def scope(plan: Plan, backend: Any) -> Iterator[Scope]:
    """Keras' global dtype policy and data format set per ``plan`` while building a model."""
    name = global_policy_name(plan)
    fmt = "channels_last" if plan.channels_last else keras.config.image_data_format()
    old_policy, old_fmt = keras.config.dtype_policy(), keras.config.image_data_format()
    keras.config.set_dtype_policy(name)
    keras.config.set_image_data_format(fmt)
    try:
        yield Scope(plan, name, fmt, backend)
    finally:
        keras.config.set_dtype_policy(old_policy)
        keras.config.set_image_data_format(old_fmt)
