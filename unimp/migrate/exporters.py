"""Write a unimp policy as another system's configuration (``unimp export``).

Each function takes a resolved :class:`unimp.Policy` and returns an
:class:`~unimp.migrate.draft.Exported`: ``.config`` (the native arguments / config sections),
``.text`` (ready to paste) and ``.unexpressed`` (one line per policy key the system cannot
express; ``.strict()`` raises ``UnsupportedError`` when there is any).

>>> import unimp
>>> from unimp.migrate import exporters
>>> exporters.keras(unimp.load("keras_mixed_float16")).config["policy"]
'mixed_float16'
"""

from __future__ import annotations

from unimp.migrate.accelerate import export_policy as accelerate
from unimp.migrate.apex import export_policy as apex
from unimp.migrate.deepspeed import export_policy as deepspeed
from unimp.migrate.flax import export_policy as flax
from unimp.migrate.jmp import export_policy as jmp
from unimp.migrate.keras import export_policy as keras
from unimp.migrate.lightning import export_policy as lightning
from unimp.migrate.megatron import export_policy as megatron
from unimp.migrate.neox import export_policy as neox
from unimp.migrate.paddle import export_policy as paddle
from unimp.migrate.torch import export_policy as torch

__all__ = ["accelerate", "apex", "deepspeed", "flax", "jmp", "keras", "lightning", "megatron", "neox", "paddle",
           "torch"]
