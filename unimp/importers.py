"""Read another system's mixed-precision configuration as a unimp policy (``unimp import``).

Each function takes the system's own arguments and returns an :class:`~unimp.migrate.common.Imported`:
``.policy`` (a resolved :class:`unimp.Policy`) and ``.text`` (the policy file, a comment on each
key naming the source key it came from). What unimp cannot express is an ``UnsupportedError``
naming the source key and the fix; malformed input a ``PolicyError``.

>>> from unimp import importers
>>> importers.torch(init_scale=1024.0).policy.loss_scale.initial
1024.0
>>> importers.deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}).policy.loss_scale.hysteresis
2
"""

from __future__ import annotations

from .migrate.accelerate import import_policy as accelerate
from .migrate.apex import import_policy as apex
from .migrate.deepspeed import import_policy as deepspeed
from .migrate.flax import import_policy as flax
from .migrate.jmp import import_policy as jmp
from .migrate.keras import import_policy as keras
from .migrate.lightning import import_policy as lightning
from .migrate.megatron import import_policy as megatron
from .migrate.paddle import import_amp_configs as paddle_amp_configs
from .migrate.paddle import import_policy as paddle
from .migrate.torch import import_policy as torch

__all__ = ["accelerate", "apex", "deepspeed", "flax", "jmp", "keras", "lightning", "megatron", "paddle",
           "paddle_amp_configs", "torch"]
