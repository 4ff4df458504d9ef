"""No import cycles in the core or in any backend package (imports read from the AST, lazy ones included)."""

from __future__ import annotations

import pytest
from imports import BACKEND_DIRS, ROOT, cycles, graph


@pytest.mark.parametrize("pkg", [ROOT / "unimp", *BACKEND_DIRS], ids=lambda p: p.name)
def test_no_import_cycle(pkg):
    assert cycles(graph(pkg)) == [], f"{pkg.name}: modules that import each other (directly or in a ring)"


def test_the_cycle_finder_sees_a_ring():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
