"""The import graph of the source tree, read from the AST (nothing is imported).

``graph(pkg_dir)`` maps each module of a package to the modules it imports (at module level or
inside a function: a lazy import closes a cycle just the same), relative imports resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the five backends, and the sixth (NumPy) reference backend the tests carry
BACKEND_DIRS = sorted(p for pattern in ("backends/*/unimp_*", "tests/sixth_backend/unimp_*")
                      for p in ROOT.glob(pattern) if (p / "__init__.py").is_file())


def module_name(path: Path, pkg_dir: Path) -> str:
    rel = path.relative_to(pkg_dir.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, pkg_dir: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) for every import in ``path``; ``from a import b`` gives ``a.b``
    when ``b`` is a module of the tree, else ``a``."""
    me = module_name(path, pkg_dir)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.append((sub if _is_module(sub, pkg_dir) else mod, node.lineno))
    return out


def _is_module(name: str, pkg_dir: Path) -> bool:
    root = pkg_dir.parent / Path(*name.split("."))
    return root.with_suffix(".py").is_file() or (root / "__init__.py").is_file()


def graph(pkg_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    top = pkg_dir.name
    modules = {module_name(p, pkg_dir): p for p in pkg_dir.rglob("*.py")}
    return {m: {i for i, _ in imports(p, pkg_dir) if i in modules and i != m and i.split(".")[0] == top}
            for m, p in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found
