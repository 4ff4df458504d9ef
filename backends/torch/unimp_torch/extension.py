"""The supported surface of unimp-torch for backends that build on it (unimp-ipex).

A package that extends the torch backend imports from this module only, never from the other ``unimp_torch`` modules:
what is listed here keeps its meaning within a unimp-torch version, the rest may change. Pin the version
(``unimp-torch==X.Y.Z``). Names load lazily, so importing this module does not import torch.

>>> from unimp_torch.extension import TorchBackend
>>> TorchBackend.name
'torch'
>>> sorted(SURFACE)[:3]
['AmpOptimizer', 'DeviceLossScale', 'NAMES']

- ``TorchBackend``: the backend class (subclass it); ``compile_plan(request, model=None, device=None, index=None,
  fp8_missing=None)``: the request -> the torch Plan; ``TorchDetails``: ``plan.details``.
- ``TorchAmp``, ``bind``: the Amp and the function that binds a Plan to a model (+ optimizer).
- ``kind``, ``type_names``, ``NAMES``: a module's canonical kind, the type names overrides match, torch's dtype
  names; ``model_index``: a model's modules as the Plan's index.
- ``check_inputs``: the argument checks ``apply`` makes; ``TorchKit``: the conformance kit.
- ``AmpOptimizer``, ``DeviceLossScale``: the optimizer wrapper and the loss-scale holder a ``TorchAmp`` runs
  (docs/backend-guide.md section 4).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

SURFACE = {
    "TorchBackend": "backend", "compile_plan": "plan", "TorchAmp": "amp", "bind": "amp", "kind": "kinds",
    "type_names": "kinds", "NAMES": "casts", "model_index": "index", "TorchDetails": "plan",
    "check_inputs": "validate", "TorchKit": "testing", "AmpOptimizer": "optimizer", "DeviceLossScale": "scaler",
}

__all__ = sorted(SURFACE)


def __getattr__(name: str) -> Any:
    if name in SURFACE:
        return getattr(import_module(f".{SURFACE[name]}", "unimp_torch"), name)
    raise AttributeError(f"module 'unimp_torch.extension' has no attribute {name!r} (the supported "
                         f"surface: {', '.join(__all__)})")
