"""The unimp Keras backend for the Keras suites, on whichever Keras backend ``KERAS_BACKEND`` names.

A tox env installs unimp-keras (its entry point registers the backend); the shared development envs
put the sources on ``PYTHONPATH`` instead, so the backend is registered here when no entry point did.

>>> keras_backend_name() in KERAS_BACKENDS
True
"""

import importlib.util
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import unimp
from unimp_keras.backend import KerasBackend
from unimp_keras.index import walk
from unimp_keras.ops import GRAPH_OPS

__all__ = ["GRAPH_OPS", "KERAS_BACKENDS", "importable_backends", "keras_backend_name", "walk"]
KERAS_BACKENDS = ("tensorflow", "jax", "torch")  # the tox envs run them in this order

if KerasBackend.name not in unimp.backends():
    unimp.register_backend(KerasBackend)


def keras_backend_name() -> str:
    """The Keras backend this process runs (``KERAS_BACKEND``)."""
    import keras

    return keras.backend.backend()


def importable_backends() -> list[str]:
    """The Keras backends whose framework this env has installed (CI: one per env)."""
    return [b for b in KERAS_BACKENDS if importlib.util.find_spec(b) is not None]
