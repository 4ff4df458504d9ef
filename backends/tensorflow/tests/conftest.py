"""Shared fixtures: quiet TensorFlow, one kit per session."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest


@pytest.fixture(scope="session")
def kit():
    from unimp_tensorflow.testing import TensorFlowKit

    return TensorFlowKit()
