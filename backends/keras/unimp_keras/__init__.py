"""unimp-keras: unimp policies on Keras 3 models, on every Keras backend (TensorFlow, JAX, torch).

``unimp.apply(policy, model, optimizer)`` binds a policy to an existing model, :func:`scope` builds a new model
under one. Importing this package imports no framework.

>>> import unimp_keras
>>> unimp_keras.KerasBackend.name
'keras'
"""

from __future__ import annotations

from typing import Any

from .backend import KerasBackend

__version__ = "0.1.0"
__all__ = ["KerasBackend", "scope"]


def scope(policy: Any) -> Any:
    """Build a Keras model under ``policy`` (file, preset name, dict or Policy): :mod:`unimp_keras.building`."""
    from unimp.spi import load

    from .building import scope as _scope

    backend = KerasBackend()
    return _scope(backend.compile(load(policy)), backend)
