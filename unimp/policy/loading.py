"""Loading and writing policies: :func:`load` (file, preset name, dict or Policy), :func:`dumps`, :func:`dump`.

The file handling, validation and ``extends`` resolution are :mod:`unimp.policy.resolve`'s (plain dicts);
this module turns their result into a :class:`Policy`.

>>> import unimp
>>> unimp.load({"name": "x", "extends": "mixed_fp16"}).compute_dtype
'float16'
>>> unimp.load({"extends": "mixed_bf16", "ops": {"lower": ["matmul", "softmax"]}}).ops.category("softmax")
'lower'
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from unimp.errors import PolicyError
from unimp.policy.resolve import (
    FORMATS,
    bad_name,
    load_named,
    preset_names,
    preset_path,
    read_file,
    resolve,
    to_text,
)
from unimp.policy.resolve import (
    extends_roots as roots_of,
)
from unimp.policy.resolved import Policy
from unimp.policy.spec import show

__all__ = ["dump", "dumps", "load", "preset_names", "preset_path", "read_file", "resolve_dict"]


def load(source: Any, *, extends_roots: Iterable[str | os.PathLike[str]] = ()) -> Policy:
    """A resolved :class:`Policy` from a file path, preset name, dict or Policy.

    ``extends`` may name a preset or a file inside the directory tree of the file that names it
    (the working directory for a dict). ``extends_roots`` (or the environment variable
    ``UNIMP_EXTENDS_ROOTS``, directories separated by ``os.pathsep``) opts other trees in.
    Raises :class:`unimp.PolicyError` naming the file, the key path and the fix.
    """
    roots = roots_of(extends_roots)
    if isinstance(source, Policy):
        return source
    if isinstance(source, dict):
        return resolve_dict(source, parent=None, source="<dict>", roots=roots)
    if isinstance(source, str | os.PathLike):
        name = os.fspath(source)
        if not isinstance(name, str) or bad_name(name):
            raise PolicyError(f"<argument>: {show(name)} is not a usable policy path or preset name")
        resolved, path = load_named(name, base=Path.cwd(), chain=(), roots=roots, named_by_user=True, spent=[0])
        return Policy.from_resolved(resolved, path)
    raise PolicyError(f"<argument>: expected a policy file path, preset name, dict or unimp.Policy, "
                      f"got {type(source).__name__}")



def resolve_dict(layer: Any, parent: dict[str, Any] | None, source: str,
                 base: Path | None = None, chain: tuple[str, ...] = (), roots: tuple[Path, ...] = ()) -> Policy:
    """Validate one layer, apply its ``extends`` (or ``parent``) and build the Policy."""
    return Policy.from_resolved(resolve(layer, parent, source, base, chain, roots), source)


def dumps(policy: Policy, fmt: str = "toml") -> str:
    """The resolved policy as TOML, YAML or JSON text (loads back to the same fingerprint)."""
    return to_text(policy.to_dict(), fmt)


def dump(policy: Policy, path: str | os.PathLike[str]) -> Path:
    """Write the resolved policy to ``path``, whole or not at all (:func:`unimp.files.write_file`); the
    format follows the file's suffix."""
    from unimp.files import shown, write_file

    p = Path(path)
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise PolicyError(f"{shown(p)}: unknown file type {shown(p.suffix)!r} (use .toml, .yaml, .yml or .json)")
    write_file(p, dumps(policy, fmt), where=f"dump({shown(p)!r})")
    return p
