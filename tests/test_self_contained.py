"""The product points nowhere outside its repository: no link to a design file that ships elsewhere,
no machine path, no "§" citation outside docs/design.md's own section references, no request logs."""

from __future__ import annotations

from imports import ROOT

SHIPPED = ("README.md", "pyproject.toml", "tox.ini", "unimp", "backends", "docs", "examples", "policies",
           "tools", "bench", "tests", "tests_models")
SUFFIXES = {".py", ".md", ".toml", ".ini", ".txt", ".rst", ".yaml", ".yml", ".json", ".cfg"}
FORBIDDEN = ("../shared", "DESIGN.md", "DESIGN §", "/work/", "CORE_REQUESTS")


def _files():
    for top in SHIPPED:
        p = ROOT / top
        paths = [p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []
        for f in paths:
            if (f.is_file() and f.suffix in SUFFIXES and f != ROOT / "tests" / "test_self_contained.py"
                    and not any(part.startswith(".") or part in {"__pycache__", "build"} or part.endswith(".egg-info")
                                for part in f.relative_to(ROOT).parts)):
                yield f


def test_nothing_points_outside_the_repository():
    bad = []
    for f in _files():
        rel = f.relative_to(ROOT)
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            hits = [s for s in FORBIDDEN if s in line]
            if "§" in line and rel.as_posix() != "docs/design.md":
                hits.append("§")
            if hits:
                bad.append(f"{rel}:{n}: {hits}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_no_request_logs_are_shipped():
    assert [f.relative_to(ROOT).as_posix() for f in _files() if f.name.startswith("CORE_REQUESTS")] == []
