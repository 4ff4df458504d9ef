"""docs/backend-guide.md's role table (section 4) is the tree: a cell starting with "yes" is a file,
any other cell is not, and every module of a backend is in the table or in the list of framework-only files."""

from __future__ import annotations

import re

from imports import ROOT

GUIDE = ROOT / "docs/backend-guide.md"
COLUMNS = ("torch", "jax", "tensorflow", "paddle", "ipex")


def _section4() -> str:
    text = GUIDE.read_text()
    start = text.index("## 4.")
    return text[start:text.index("\n## ", start + 1)]


def _table() -> dict[str, dict[str, str]]:
    lines = _section4().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| file |"))
    body = []
    for line in lines[first + 2:]:
        if not line.strip():
            break
        assert line.startswith("|"), f"{GUIDE.name}: the role table is broken by the line {line!r}"
        body.append(line)
    header = [c.strip() for c in lines[first].strip("|").split("|")]
    assert tuple(header[2:]) == COLUMNS
    rows = {}
    for line in body:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = dict(zip(COLUMNS, cells[2:], strict=True))
    return rows


def _only_one_framework() -> dict[str, set[str]]:
    para = _section4().split("Files only one framework needs", 1)[1].split("No import cycles", 1)[0]
    out: dict[str, set[str]] = {c: set() for c in COLUMNS}
    for chunk in re.split(r";", para):
        named = [c for c in COLUMNS if re.search(rf"\b{c}\b", chunk)]
        if named:
            out[named[0]] |= {f.rstrip("/") for f in re.findall(r"`([\w/]+(?:\.py|/))`", chunk)}
    return out


def _modules(col: str) -> set[str]:
    pkg = ROOT / "backends" / col / f"unimp_{col}"
    return {p.relative_to(pkg).parts[0] for p in pkg.rglob("*.py")} - {"__init__.py"}


def test_the_role_table_matches_every_backend_tree():
    rows, wrong = _table(), []
    for file, cells in rows.items():
        for col, cell in cells.items():
            there = (ROOT / "backends" / col / f"unimp_{col}" / file).is_file()
            if cell.startswith("yes") != there:
                wrong.append(f"{file} in {col}: the table says {cell!r}, the file is {'there' if there else 'absent'}")
    assert not wrong, "\n".join(wrong)


def test_every_backend_module_is_in_the_guide():
    rows, extra = _table(), _only_one_framework()
    missing = {col: sorted(_modules(col) - set(rows) - extra[col]) for col in COLUMNS}
    assert not any(missing.values()), f"modules the backend guide does not name: {missing}"


def test_backends_read_layer_decisions_from_the_plan():
    """``Plan.decide`` is the contract: no backend module decides a layer from the policy itself
    (``policy.decide``: overrides resolved again, maybe with another compute dtype)."""
    from imports import BACKEND_DIRS

    pattern = re.compile(r"\bpolic(y|ies)\.decide\(")
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
           for d in BACKEND_DIRS for p in sorted(d.rglob("*.py"))
           for n, line in enumerate(p.read_text().splitlines(), 1)
           if pattern.search(line) and not line.lstrip().startswith(("#", ">>>"))]
    assert not bad, "\n".join(bad)
