"""Every package of the core ships: pyproject's explicit package list names each folder of ``unimp/``
(a folder left out imports from a checkout and fails once installed, as the tox envs install it)."""

import tomllib

from imports import ROOT


def test_every_core_package_is_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "unimp").rglob("__init__.py")}
    assert sorted(folders - listed) == []


def test_every_distribution_ships_its_annotations():
    """PEP 561: the core and each backend mark their package typed (``py.typed``) and ship the marker
    (package data), so a type checker of code using them reads their annotations."""
    wrong = []
    for pyproject in [ROOT / "pyproject.toml", *sorted((ROOT / "backends").glob("*/pyproject.toml"))]:
        setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
        top = setuptools["packages"][0]
        where = pyproject.parent / setuptools.get("package-dir", {}).get(top, top)
        if not (where / "py.typed").is_file():
            wrong.append(f"{where.relative_to(ROOT)}: no py.typed")
        if "py.typed" not in setuptools.get("package-data", {}).get(top, []):
            wrong.append(f"{pyproject.relative_to(ROOT)}: [tool.setuptools.package-data] {top} lacks py.typed")
    assert not wrong, "\n".join(wrong)
