"""Two XLA:CPU devices for the data-parallel tests (this folder runs in its own pytest process).

``--xla_force_host_platform_device_count`` is read when JAX starts its CPU client, so it is set here,
before anything imports jax. In a process where JAX already started with one device (e.g.
``pytest backends/jax``, which loads ``tests/conftest.py`` first) the tests skip, naming the fix —
unless ``UNIMP_JAX_REQUIRE_DEVICES=1`` (set by ``tox -e jax``), where that is a failure.
"""

import os
import re

_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=2".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def two_devices():
    n = jax.device_count()
    if n < 2:
        msg = (f"JAX started with {n} device before this folder's conftest set "
               f"--xla_force_host_platform_device_count=2; fix: run it in its own process: "
               f"pytest backends/jax/tests_distributed")
        if os.environ.get("UNIMP_JAX_REQUIRE_DEVICES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
