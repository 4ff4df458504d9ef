"""Shared fixtures: one kit per API, reused so compiled steps are cached across cases."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from unimp_jax.testing import LinenKit, NnxKit

_KITS = {"nnx": NnxKit(), "linen": LinenKit()}


@pytest.fixture(params=sorted(_KITS))
def kit(request):
    return _KITS[request.param]


@pytest.fixture
def nnx_kit():
    return _KITS["nnx"]


@pytest.fixture
def linen_kit():
    return _KITS["linen"]
