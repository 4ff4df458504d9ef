"""Every package of the core ships: pyproject's explicit package list names each folder of ``unimp/``
(a folder left out imports from a checkout and fails once installed, as the tox envs install it)."""

import tomllib

from imports import ROOT


def test_every_core_package_is_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "unimp").rglob("__init__.py")}
    assert sorted(folders - listed) == []
