"""Shared fixtures: the Paddle conformance kit, quiet Paddle logs, legacy IR for static tests."""

import os
import warnings

os.environ.setdefault("GLOG_minloglevel", "2")
os.environ.setdefault("FLAGS_use_mkldnn", "0")
os.environ.setdefault("FLAGS_enable_pir_api", "0")  # legacy IR for the static path (read at import)

import pytest

warnings.filterwarnings("ignore", message="amp_guard can only be enabled", category=UserWarning)
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)


@pytest.fixture(scope="session")
def kit():
    from unimp_paddle.testing import PaddleKit

    return PaddleKit()
