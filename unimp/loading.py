"""Reading, resolving (``extends``) and writing policy files.

>>> import unimp
>>> unimp.load({"name": "x", "extends": "mixed_fp16"}).compute_dtype
'float16'
>>> unimp.load({"extends": "mixed_bf16", "ops": {"lower": ["matmul", "softmax"]}}).ops.category("softmax")
'lower'
"""

from __future__ import annotations

import copy
import functools
import json
import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import PolicyError
from .ops import OP_LISTS, suggest
from .policy import Policy
from .spec import DEFAULTS, TABLES, Problems, check_layer, check_resolved

MAX_FILE_BYTES = 256 * 1024
FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}
MAX_EXTENDS_DEPTH = 32


@functools.cache
def _preset_dir() -> Path:
    """``policies/``: installed as the package ``unimp.policies``, or beside ``unimp/`` in a checkout."""
    try:
        return Path(str(resources.files("unimp.policies")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "policies"


def preset_names() -> list[str]:
    """Names of the shipped presets (files in ``policies/``)."""
    return list(_preset_names())


@functools.cache
def _preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _preset_dir().glob("*.toml")))


def preset_path(name: str) -> Path:
    return _preset_dir() / f"{name}.toml"


def load(source: Any) -> Policy:
    """A resolved :class:`Policy` from a file path, preset name, dict or Policy.

    Raises :class:`unimp.PolicyError` naming the file, the key path and the fix.
    """
    if isinstance(source, Policy):
        return source
    if isinstance(source, dict):
        return resolve_dict(source, parent=None, source="<dict>")
    if isinstance(source, str | os.PathLike):
        return _load_named(os.fspath(source), base=Path.cwd(), chain=())
    raise PolicyError(f"<argument>: expected a policy file path, preset name, dict or unimp.Policy, "
                      f"got {type(source).__name__}")


def resolve_dict(layer: Any, parent: dict[str, Any] | None, source: str,
                 base: Path | None = None, chain: tuple[str, ...] = ()) -> Policy:
    """Validate one layer, apply its ``extends`` (or ``parent``) and build the Policy."""
    return Policy.from_resolved(_resolve(layer, parent, source, base or Path.cwd(), chain), source)


def _resolve(layer: Any, parent: dict[str, Any] | None, source: str, base: Path,
             chain: tuple[str, ...]) -> dict[str, Any]:
    problems = Problems(source)
    checked = check_layer(layer, problems)
    if problems.items:
        raise PolicyError(problems.items)
    extends = checked.pop("extends", None)
    if extends is not None:
        try:
            parent = _load_named(extends, base=base, chain=chain).to_dict()
        except PolicyError as e:
            raise PolicyError([f"{source}: extends: {p}" for p in e.problems]) from None
    merged = merge(parent if parent is not None else DEFAULTS, checked)
    check_resolved(merged, problems)
    if problems.items:
        raise PolicyError(problems.items)
    return merged


def merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Tables merge key by key, lists replace; an op the child lists leaves the parent's other lists.

    A child that sets ``loss_scale.mode = "dynamic"`` gets ``skip_nonfinite = true`` unless it says
    otherwise (a parent like ``mixed_bf16`` turns skipping off for its ``none`` mode).
    """
    out = copy.deepcopy(parent)
    for key, value in child.items():
        if key in TABLES:
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    ls = child.get("loss_scale", {})
    if ls.get("mode") == "dynamic" and "skip_nonfinite" not in ls:
        out["loss_scale"]["skip_nonfinite"] = True  # dynamic scaling backs off *and skips*; never inherit false
    if "ops" in child:
        given = child["ops"]
        moved = {op for ops in given.values() for op in ops}
        for lst in OP_LISTS:
            if lst not in given:
                out["ops"][lst] = [op for op in out["ops"][lst] if op not in moved]
    return out


def _load_named(name: str, base: Path, chain: tuple[str, ...]) -> Policy:
    path = _locate(name, base)
    key = str(path.resolve())
    if key in chain:
        cycle = " -> ".join([*chain, key])
        raise PolicyError(f"{path}: extends: cycle ({cycle}); remove one of the `extends`")
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise PolicyError(f"{path}: extends: more than {MAX_EXTENDS_DEPTH} levels deep")
    raw = read_file(path)
    return Policy.from_resolved(_resolve(raw, None, str(path), path.parent, (*chain, key)), str(path))


def _locate(name: str, base: Path) -> Path:
    names = preset_names()
    looks_like_path = any(sep in name for sep in "/\\") or Path(name).suffix in FORMATS
    if not looks_like_path and name in names:
        return preset_path(name)
    path = Path(name) if Path(name).is_absolute() else base / name
    if path.is_file():
        return path
    if looks_like_path:
        raise PolicyError(f"{name}: no such file (looked in {base})")
    hint = suggest(name, names)
    tail = f"did you mean '{hint}'?" if hint else f"presets: {', '.join(names)}"
    raise PolicyError(f"{name!r}: not a policy file and not a preset ({tail})")


def read_file(path: Path) -> Any:
    """Parse a TOML/YAML/JSON file into plain data; every failure is a located PolicyError."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise PolicyError(f"{path}: unknown file type {path.suffix!r} (use .toml, .yaml, .yml or .json)")
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise PolicyError(f"{path}: {size} bytes; a policy file is at most {MAX_FILE_BYTES} bytes")
        data = path.read_bytes()
    except OSError as e:
        raise PolicyError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        return parse_text(text, fmt)
    except PolicyError as e:
        raise PolicyError(f"{path}: {e}") from None


def parse_text(text: str, fmt: str) -> Any:
    """Parse policy text of one format (``toml`` | ``yaml`` | ``json``)."""
    try:
        if fmt == "toml":
            return tomllib.loads(text)
        if fmt == "json":
            return json.loads(text)
        import yaml

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return yaml.load(text, Loader=loader)
    except RecursionError:
        raise PolicyError(f"not valid {fmt.upper()}: nested too deeply") from None
    except Exception as e:  # parser errors of three libraries; message kept, no traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PolicyError(f"not valid {fmt.upper()}: {first}") from None


def dumps(policy: Policy, fmt: str = "toml") -> str:
    """The resolved policy as TOML, YAML or JSON text (loads back to the same fingerprint)."""
    d = policy.to_dict()
    if fmt == "toml":
        import tomli_w

        return tomli_w.dumps(d)
    if fmt == "json":
        return json.dumps(d, indent=2)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(d, sort_keys=False)
    raise PolicyError(f"<argument>: format {fmt!r} is not one of toml, yaml, json")


def dump(policy: Policy, path: str | os.PathLike) -> Path:
    """Write the resolved policy to ``path``; the format follows the file's suffix."""
    p = Path(path)
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise PolicyError(f"{p}: unknown file type {p.suffix!r} (use .toml, .yaml, .yml or .json)")
    p.write_text(dumps(policy, fmt))
    return p
