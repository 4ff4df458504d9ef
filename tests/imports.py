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


# ---------------------------------------------------------------- the plug-in boundary

# what a backend package may import of the core: the plug-in surface, and (for its conformance kit) the
# kit and probe modules; a doctest may also `import unimp`, as the user it shows does
# unimp.spi; the conformance kit's bases; the watch's bases (a backend's watch.py subclasses EagerWatch or uses
# the traced taps)
PLUGIN_MODULES = frozenset({"unimp.spi", "unimp.conformance.kit", "unimp.conformance.probe", "unimp.watch.eager",
                            "unimp.watch.traced"})
DOCTEST_MODULES = PLUGIN_MODULES | {"unimp"}


def _doctest_source(text: str) -> str:
    """The code of every doctest example in ``text`` (``>>>`` and ``...`` lines, prompts removed)."""
    lines = [ln.strip()[4:] for ln in text.splitlines() if ln.strip().startswith((">>> ", "... "))]
    return "\n".join(ln for ln in lines if ln.startswith(("import ", "from ")))


def core_uses(path: Path, pkg_dir: Path) -> list[tuple[str, int, str]]:
    """(core module, line, how) for every use of the core in ``path``: import statements, imports in
    doctests, and module names passed to ``importlib.import_module`` / ``__import__`` as strings."""
    out = [(m, line, "import") for m, line in imports(path, pkg_dir) if m.split(".")[0] == "unimp"]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and node.args[0].value.split(".")[0] == "unimp":
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("import_module", "__import__"):
                out.append((node.args[0].value, node.lineno, "importlib"))
        doc = ast.get_docstring(node) if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                                           ast.ClassDef)) else None
        if doc:
            line = getattr(node, "lineno", 1)
            for sub in ast.walk(ast.parse(_doctest_source(doc))):
                mods = ([a.name for a in sub.names] if isinstance(sub, ast.Import)
                        else [sub.module or ""] if isinstance(sub, ast.ImportFrom) else [])
                out += [(m, line, "doctest") for m in mods if m.split(".")[0] == "unimp"]
    return out


def boundary_violations(pkg_dir: Path) -> list[str]:
    """Every use of the core in a backend package outside :data:`PLUGIN_MODULES` (doctests: also ``unimp``)."""
    return [f"{p.relative_to(ROOT)}:{line}: {how} {mod}"
            for p in sorted(pkg_dir.rglob("*.py")) for mod, line, how in core_uses(p, pkg_dir)
            if mod not in (DOCTEST_MODULES if how == "doctest" else PLUGIN_MODULES)]
