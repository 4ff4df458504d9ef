"""Build a Keras model from scratch under a policy: ``with unimp_tensorflow.scope(policy) as s:``.

Inside the scope Keras' global dtype policy is the policy's (``mixed_bfloat16`` for bf16 compute
over float32 params, ``bfloat16`` for pure bf16) and ``image_data_format`` follows
``layout.channels_last``, so new layers create their variables in the right dtype and layout.
The per-layer rules (float32 list, follow-inputs, overrides) and loss scaling then come from
``s.apply(model, optimizer)`` (= ``unimp.apply``); leaving the scope restores Keras' globals.

>>> import keras
>>> with scope("mixed_bf16") as s:
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

from unimp.spi import Policy, apply, is_low, load

from .plan import compile_plan


@dataclass(frozen=True)
class Scope:
    """The policy a model is being built under."""

    policy: Policy
    keras_policy: str
    data_format: str

    def apply(self, model: Any, optimizer: Any = None, **options: Any) -> Any:
        """``unimp.apply(policy, model, optimizer)`` for the model built in this scope."""
        return apply(self.policy, model, optimizer, backend="tensorflow", **options)


def global_policy_name(policy: Policy, compute: str) -> str:
    """The Keras global policy for building under ``policy`` (compute ``compute``)."""
    if not is_low(compute):
        return "float32"
    return compute if policy.param_dtype == compute else f"mixed_{compute}"


@contextmanager
def scope(policy: Any) -> Iterator[Scope]:
    """Keras' global dtype policy and data format set per ``policy`` while building a model."""
    import keras

    pol = load(policy)
    plan = compile_plan(pol)
    name = global_policy_name(pol, plan.compute_dtype)
    fmt = "channels_last" if pol.layout.channels_last else keras.config.image_data_format()
    old_policy, old_fmt = keras.config.dtype_policy(), keras.config.image_data_format()
    keras.config.set_dtype_policy(name)
    keras.config.set_image_data_format(fmt)
    try:
        yield Scope(pol, name, fmt)
    finally:
        keras.config.set_dtype_policy(old_policy)
        keras.config.set_image_data_format(old_fmt)
