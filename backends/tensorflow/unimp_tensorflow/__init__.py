"""unimp-tensorflow: the former name of :mod:`unimp_keras` (Keras 3 on every Keras backend).

Kept so ``pip install unimp-tensorflow`` and ``import unimp_tensorflow`` keep working: it installs
unimp-keras with TensorFlow, and re-exports the public names (``TensorFlowBackend`` is
:class:`unimp_keras.KerasBackend`, backend name ``"keras"``). It registers no backend of its own:
unimp-keras' entry point is the one backend for Keras models. Importing it imports no framework.

>>> import unimp_tensorflow, unimp_keras
>>> unimp_tensorflow.TensorFlowBackend is unimp_keras.KerasBackend
True
"""

from __future__ import annotations

from typing import Any

from unimp_keras import KerasBackend, scope

__version__ = "0.1.0"
TensorFlowBackend = KerasBackend
__all__ = ["AmpOptimizer", "KerasAmp", "KerasAmpOptimizer", "KerasBackend", "TensorFlowAmp", "TensorFlowBackend",
           "scope"]

# name -> (module of unimp_keras, its name there); imported on first use (they import keras)
_LAZY = {"AmpOptimizer": ("optimizer", "AmpOptimizer"), "KerasAmpOptimizer": ("optimizer", "KerasAmpOptimizer"),
         "KerasAmp": ("amp", "KerasAmp"), "TensorFlowAmp": ("amp", "KerasAmp")}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'unimp_tensorflow' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    return getattr(importlib.import_module(f"unimp_keras.{module}"), attr)
