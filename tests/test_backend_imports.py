"""Backends build on the core through ``unimp.spi`` only (read from the source, nothing imported)."""

from __future__ import annotations

from imports import BACKEND_DIRS, ROOT, imports

import unimp.spi


def test_every_backend_package_is_seen():
    assert {d.name for d in BACKEND_DIRS} >= {"unimp_torch", "unimp_jax", "unimp_tensorflow", "unimp_paddle",
                                              "unimp_ipex"}


def test_backends_import_the_core_only_through_unimp_spi():
    bad = [f"{p.relative_to(ROOT)}:{line}: {mod}"
           for d in BACKEND_DIRS for p in sorted(d.rglob("*.py"))
           for mod, line in imports(p, d)
           if mod.split(".")[0] == "unimp" and mod != "unimp.spi"]
    assert not bad, "backends import core modules other than unimp.spi (add the name to unimp/spi.py):\n" + \
        "\n".join(bad)


def test_every_name_in_spi_all_is_there():
    assert sorted(n for n in unimp.spi.__all__ if not hasattr(unimp.spi, n)) == []
    assert len(set(unimp.spi.__all__)) == len(unimp.spi.__all__)
