"""Shared fixtures: quiet TensorFlow, one kit per session, the Keras backend this run uses.

The suite runs under ``KERAS_BACKEND=tensorflow``, ``jax`` and ``torch``; a test that only one Keras backend
can run is marked ``@pytest.mark.keras_backend("tensorflow")`` and skipped under the others.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest

# Modules whose subject is TensorFlow's own (tf.distribute, tf.config GPU detection): collected only under
# KERAS_BACKEND=tensorflow. Every other module runs on each Keras backend with that backend's own step
# (unimp_keras.steps); single TensorFlow-only tests (the eager float8 refusal, tf_keras) are marked
# @pytest.mark.keras_backend("tensorflow").
TENSORFLOW_ONLY = {
    "test_distributed.py": "tf.distribute",
    "distributed_worker.py": "tf.distribute",
}


def _keras_backend() -> str:
    import keras

    return keras.backend.backend()


def pytest_ignore_collect(collection_path, config):
    if collection_path.name in TENSORFLOW_ONLY and _keras_backend() != "tensorflow":
        return True
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "keras_backend(*names): runs only under these KERAS_BACKENDs")
    import unimp.backend.registry as registry

    if "keras" not in registry.backends():  # an env that still has the old unimp-tensorflow installed
        from unimp_keras.backend import KerasBackend

        registry.register_backend(KerasBackend)


def pytest_collection_modifyitems(config, items):
    here = _keras_backend()
    for item in items:
        marker = item.get_closest_marker("keras_backend")
        if marker is not None and here not in marker.args:
            item.add_marker(pytest.mark.skip(reason=f"needs KERAS_BACKEND in {marker.args} (this run: {here})"))


@pytest.fixture(scope="session")
def kit():
    from unimp_keras.testing import KerasKit

    return KerasKit()
