"""Doctests of unimp_keras under every Keras backend: the TensorFlow-only modules are collected only under
KERAS_BACKEND=tensorflow (the other envs have no TensorFlow)."""

import os

TENSORFLOW_ONLY = ("unimp_keras/tf_distribute.py", "unimp_keras/tf_scale.py")


def pytest_ignore_collect(collection_path, config):
    if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow" and \
            collection_path.as_posix().endswith(TENSORFLOW_ONLY):
        return True
    return None
