"""Read another system's mixed-precision configuration as a unimp policy (``unimp import``).

Each function takes the system's own arguments and returns an :class:`~unimp.migrate.draft.Imported`:
``.policy`` (a resolved :class:`unimp.Policy`) and ``.text`` (the policy file, a comment on each
key naming the source key it came from). What unimp cannot express is an ``UnsupportedError``
naming the source key and the fix; malformed input a ``PolicyError``.

>>> from unimp.migrate import importers
>>> importers.torch(init_scale=1024.0).policy.loss_scale.initial
1024.0
>>> importers.deepspeed({"fp16": {"enabled": True}, "zero_optimization": {"stage": 1}}).policy.loss_scale.hysteresis
2
"""

from __future__ import annotations

from unimp.migrate.accelerate import import_policy as accelerate
from unimp.migrate.apex import import_policy as apex
from unimp.migrate.deepspeed import import_policy as deepspeed
from unimp.migrate.flax import import_policy as flax
from unimp.migrate.jmp import import_policy as jmp
from unimp.migrate.keras import import_policy as keras
from unimp.migrate.lightning import import_policy as lightning
from unimp.migrate.megatron import import_policy as megatron
from unimp.migrate.neox import import_policy as neox
from unimp.migrate.paddle import import_amp_configs as paddle_amp_configs
from unimp.migrate.paddle import import_policy as paddle
from unimp.migrate.torch import import_policy as torch

__all__ = ["accelerate", "apex", "deepspeed", "flax", "jmp", "keras", "lightning", "megatron", "neox", "paddle",
           "paddle_amp_configs", "torch"]
