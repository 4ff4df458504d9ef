"""Write a unimp policy as another system's configuration (``unimp export``).

Each function takes a resolved :class:`unimp.Policy` and returns an
:class:`~unimp.migrate.common.Exported`: ``.config`` (the native arguments / config sections),
``.text`` (ready to paste) and ``.unexpressed`` (one line per policy key the system cannot
express; ``.strict()`` raises ``UnsupportedError`` when there is any).

>>> import unimp
>>> from unimp import exporters
>>> exporters.keras(unimp.load("keras_mixed_float16")).config["policy"]
'mixed_float16'
"""

from __future__ import annotations

from .migrate.accelerate import export_policy as accelerate
from .migrate.apex import export_policy as apex
from .migrate.deepspeed import export_policy as deepspeed
from .migrate.flax import export_policy as flax
from .migrate.jmp import export_policy as jmp
from .migrate.keras import export_policy as keras
from .migrate.lightning import export_policy as lightning
from .migrate.megatron import export_policy as megatron
from .migrate.paddle import export_policy as paddle
from .migrate.torch import export_policy as torch

__all__ = ["accelerate", "apex", "deepspeed", "flax", "jmp", "keras", "lightning", "megatron", "paddle", "torch"]
