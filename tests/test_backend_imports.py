"""Backends build on the core through ``unimp.spi`` only (read from the source, nothing imported)."""

from __future__ import annotations

from imports import BACKEND_DIRS, ROOT, boundary_violations

import unimp.spi


def test_every_backend_package_is_seen():
    assert {d.name for d in BACKEND_DIRS} >= {"unimp_torch", "unimp_jax", "unimp_keras", "unimp_paddle",
                                              "unimp_ipex"}


def test_backends_import_the_core_only_through_the_plugin_surface():
    bad = [v for d in BACKEND_DIRS for v in boundary_violations(d)]
    assert not bad, ("backends use core modules other than unimp.spi (and unimp.conformance.kit / .probe for the "
                     "kit, unimp.watch.eager / .traced for the watch; doctests may also import unimp): add the "
                     "name to unimp/spi.py or read it from the Plan:\n"
                     + "\n".join(bad))


def test_the_boundary_check_sees_doctests_and_importlib_strings(tmp_path):
    pkg = tmp_path / "unimp_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Demo.\n\n>>> from unimp.hardware import cpu\n>>> import unimp\n"""\n'
                                     'import importlib\nimportlib.import_module("unimp.conformance.checks")\n'
                                     'from unimp.spi import Plan\n')
    import imports

    saved = imports.ROOT
    imports.ROOT = tmp_path
    try:
        found = boundary_violations(pkg)
    finally:
        imports.ROOT = saved
    assert sorted(found) == ["unimp_demo/__init__.py:1: doctest unimp.hardware",
                             "unimp_demo/__init__.py:7: importlib unimp.conformance.checks"], found


def test_the_plugin_surface_is_narrow():
    """At most 28 names, the Policy not among them (a backend reads the Plan), no framework's names."""
    assert len(unimp.spi.__all__) <= 28, sorted(unimp.spi.__all__)
    assert "Policy" not in unimp.spi.__all__
    assert not [n for n in unimp.spi.__all__ if n.split("_")[0] in ("PADDLE", "TORCH", "JAX", "TF", "KERAS")]


def test_every_name_in_spi_all_is_there():
    assert sorted(n for n in unimp.spi.__all__ if not hasattr(unimp.spi, n)) == []
    assert len(set(unimp.spi.__all__)) == len(unimp.spi.__all__)


def test_ipex_builds_on_unimp_torch_only_through_its_extension_surface():
    import ast

    ext = ROOT / "backends/torch/unimp_torch/extension.py"
    surface = next(ast.literal_eval(n.value) for n in ast.parse(ext.read_text()).body
                   if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "SURFACE")
    ipex = ROOT / "backends/ipex/unimp_ipex"
    used, bad = set(), []
    for p in sorted(ipex.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if m.split(".")[0] == "unimp_torch" and m != "unimp_torch.extension":
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}: {m}")
            if isinstance(node, ast.ImportFrom) and node.module == "unimp_torch.extension":
                used |= {a.name for a in node.names}
    assert not bad, "unimp_ipex imports unimp_torch modules other than unimp_torch.extension:\n" + "\n".join(bad)
    assert used and used <= set(surface), f"not in unimp_torch.extension.SURFACE: {sorted(used - set(surface))}"


def test_ipex_pins_the_unimp_torch_version_it_was_built_against():
    import tomllib

    torch_version = tomllib.loads((ROOT / "backends/torch/pyproject.toml").read_text())["project"]["version"]
    deps = tomllib.loads((ROOT / "backends/ipex/pyproject.toml").read_text())["project"]["dependencies"]
    assert f"unimp-torch=={torch_version}" in deps
