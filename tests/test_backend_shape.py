"""docs/backend-guide.md's role table (section 4) is the tree: a cell starting with "yes" is a file,
any other cell is not, and every module of a backend is in the table or in the list of framework-only files."""

from __future__ import annotations

import re

from imports import ROOT

GUIDE = ROOT / "docs/backend-guide.md"
COLUMNS = ("torch", "jax", "keras", "paddle", "ipex")


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


FRAMEWORK = {"torch": "Torch", "jax": "Jax", "keras": "Keras", "paddle": "Paddle", "ipex": "Ipex"}


def _required() -> dict[str, tuple[str, ...]]:
    """The guide's required role files -> the names each must define (``<F>`` per framework)."""
    return {file: names for file, (names, _) in _required_table().items()}


def _required_table() -> dict[str, tuple[tuple[str, ...], dict[str, str]]]:
    """The guide's required role files -> (the names each must define, {backend: the backend it takes the
    role from unchanged}, e.g. ``{"ipex": "torch"}`` from a cell ``ipex: torch's (...)``)."""
    lines = _section4().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| required file |"))
    out = {}
    for line in lines[first + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        taken = dict(re.findall(rf"\b({'|'.join(COLUMNS)}): ({'|'.join(COLUMNS)})'s\b", cells[3]))
        out[cells[0].strip("`")] = (tuple(re.findall(r"`([^`]+)`", cells[2])), taken)
    return out


def _defined(path) -> set[str]:
    """Names a module defines at top level: classes, functions, assignments, and names it imports."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def test_every_backend_has_every_required_role_file_with_its_name():
    """Each required role is a file defining its name, or, where the guide says a backend takes the role from
    another one unchanged, no file at all (no re-export stub) and an import of that backend in its package."""
    required, wrong = _required_table(), []
    assert {"backend.py", "plan.py", "amp.py", "testing.py"} <= set(required)
    for col, f in FRAMEWORK.items():
        pkg = ROOT / "backends" / col / f"unimp_{col}"
        for file, (names, taken) in required.items():
            if col in taken:
                source = taken[col]
                if (pkg / file).is_file():
                    wrong.append(f"{col}: {file} is there, but the guide says {col} takes the role from {source}; "
                                 f"remove the file or the guide's `{col}: {source}'s`")
                elif not any(f"unimp_{source}" in p.read_text() for p in pkg.rglob("*.py")):
                    wrong.append(f"{col}: takes {file}'s role from {source}, but imports nothing of unimp_{source}")
                continue
            if not (pkg / file).is_file():
                wrong.append(f"{col}: no {file}")
                continue
            missing = sorted({n.replace("<F>", f) for n in names} - _defined(pkg / file))
            if missing:
                wrong.append(f"{col}/{file}: does not define {', '.join(missing)}")
    assert not wrong, "\n".join(wrong)


def test_a_role_is_taken_only_from_a_backend_that_has_it():
    """A backend named as the source of a role (``ipex: torch's``) has that role's file itself."""
    required = _required_table()
    assert any(taken for _, taken in required.values()), "the guide's last column names no backend"
    for file, (_, taken) in required.items():
        for col, source in taken.items():
            assert source != col and (ROOT / "backends" / source / f"unimp_{source}" / file).is_file(), (col, file)


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
    missing = {col: sorted(_modules(col) - set(rows) - set(_required()) - extra[col]) for col in COLUMNS}
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


def test_backends_read_no_override_list():
    """The core resolves the overrides (``request.decide``, ``request.override_dtypes``, ``plan.decide``):
    no backend module reads an override list (``plan.overrides``, ``request.overrides``, ...)."""
    import ast

    from imports import BACKEND_DIRS

    bad = [f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
           for d in BACKEND_DIRS for p in sorted(d.rglob("*.py"))
           for node in ast.walk(ast.parse(p.read_text(), str(p)))
           if isinstance(node, ast.Attribute) and node.attr == "overrides"
           and not (isinstance(node.value, ast.Name) and node.value.id == "torch")]  # torch.overrides: a module
    assert not bad, "backends read an override list (ask the request or the Plan):\n" + "\n".join(bad)


def _policy_reads(path) -> list[str]:
    """Every read of a Policy in one backend module: ``x.policy``, ``policy.<knob>`` (also ``pol``,
    ``policies``) and the name ``Policy`` itself (a backend gets a Plan, never a Policy)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and (node.attr == "policy" or (
                isinstance(node.value, ast.Name) and node.value.id in ("policy", "pol", "policies"))):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Name) and node.id == "Policy":
            out.append((node.lineno, "Policy"))
        elif isinstance(node, ast.alias) and node.name == "Policy":
            out.append((getattr(node, "lineno", 0), "import Policy"))
    return [f"{path.relative_to(ROOT)}:{n}: {what}" for n, what in out]


def test_backends_hold_no_policy():
    """The Plan is a backend's only input: no backend module reads a Policy (``Backend.compile`` in the core
    turns the policy into ``Plan.request(policy)``; the backend's ``plan`` returns ``request.compile(...)``)."""
    from imports import BACKEND_DIRS

    bad = [v for d in BACKEND_DIRS for p in sorted(d.rglob("*.py")) for v in _policy_reads(p)]
    assert not bad, "backends read a Policy (read the Plan: plan.param_dtype, plan.decide(...), ...):\n" + \
        "\n".join(bad)


def test_the_policy_read_check_sees_each_form(tmp_path):
    p = ROOT / "tests" / "_policy_reads_demo.py"
    try:
        p.write_text("def f(plan, policy, amp):\n    a = amp.policy\n    b = policy.param_dtype\n"
                     "    c: Policy = plan\n    return plan.param_dtype\n")
        found = [v.split(": ", 1)[1] for v in _policy_reads(p)]
    finally:
        p.unlink()
    assert sorted(found) == ["Policy", "amp.policy", "policy.param_dtype"], found
