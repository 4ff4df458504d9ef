"""Policy data: read and parse policy files, validate, resolve ``extends``, merge, write text.

Everything here works on plain dicts (the resolved form :meth:`unimp.Policy.from_resolved` takes);
:mod:`unimp.policy.loading` turns them into :class:`~unimp.Policy` objects.

>>> resolve({"extends": "mixed_fp16", "name": "x"}, None, "<dict>")["compute_dtype"]
'float16'
>>> print(to_text({"name": "x"}, "json"))
{
  "name": "x"
}
"""

from __future__ import annotations

import copy
import errno
import functools
import json
import math
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from unimp.errors import PolicyError
from unimp.policy.ops import OP_LISTS
from unimp.policy.spec import DEFAULTS, TABLES, TOP, Problems, check_layer, check_resolved, hint, short

MAX_FILE_BYTES = 256 * 1024
FORMATS = {".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".json": "json"}
MAX_EXTENDS_DEPTH = 32
EXTENDS_ROOTS_ENV = "UNIMP_EXTENDS_ROOTS"
PSEUDO_FS = {("/", "proc"), ("/", "sys"), ("/", "dev")}
MAX_KEY_PARTS = 16  # dotted TOML keys deeper than this are refused before parsing (tomllib is quadratic)
_KEY_PART = r"""(?:[A-Za-z0-9_-]+|"[^"\n]*"|'[^'\n]*')"""
_DEEP_KEY = re.compile(rf"(?:^|[\[{{,])[ \t]*{_KEY_PART}(?:[ \t]*\.[ \t]*{_KEY_PART}){{{MAX_KEY_PARTS},}}",
                       re.MULTILINE)


@functools.cache
def _preset_dir() -> Path:
    """``policies/``: installed as the package ``unimp.policies``, or beside ``unimp/`` in a checkout."""
    try:
        return Path(str(resources.files("unimp.policies")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "policies"


def preset_names() -> list[str]:
    """Names of the shipped presets (files in ``policies/``)."""
    return list(_preset_names())


@functools.cache
def _preset_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in _preset_dir().glob("*.toml")))


def preset_path(name: str) -> Path:
    return _preset_dir() / f"{name}.toml"


def extends_roots(extra: Iterable[str | os.PathLike[str]]) -> tuple[Path, ...]:
    """Directory trees ``extends`` may read besides the naming file's own (explicit opt-in)."""
    env = [p for p in os.environ.get(EXTENDS_ROOTS_ENV, "").split(os.pathsep) if p]
    try:
        return tuple(Path(p).resolve() for p in [*env, *extra])
    except (OSError, ValueError, RuntimeError) as e:
        raise PolicyError(f"<argument>: extends_roots / {EXTENDS_ROOTS_ENV}: unusable directory ({e})") from None


def bad_name(name: str) -> bool:
    return len(name) > TOP["extends"].max_len or "\x00" in name


def resolve(layer: Any, parent: dict[str, Any] | None, source: str, base: Path | None = None,
            chain: tuple[str, ...] = (), roots: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Validate one layer and apply its ``extends`` (or ``parent``): the resolved dict."""
    return _resolve(layer, parent, source, base or Path.cwd(), chain, roots)


def _resolve(layer: Any, parent: dict[str, Any] | None, source: str, base: Path,
             chain: tuple[str, ...], roots: tuple[Path, ...] = (), spent: list[int] | None = None) -> dict[str, Any]:
    problems = Problems(source)
    checked = check_layer(layer, problems)
    problems.raise_if_any()
    extends = checked.pop("extends", None)
    if extends is not None:
        try:
            parent, _ = load_named(extends, base=base, chain=chain, roots=roots, spent=spent)
        except PolicyError as e:
            raise PolicyError([f"{source}: extends: {p}" for p in e.problems]) from None
    merged = merge(parent if parent is not None else DEFAULTS, checked)
    check_resolved(merged, problems)
    problems.raise_if_any()
    return merged


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys: ``{"loss_scale": {"mode": "none"}}`` -> ``{"loss_scale.mode": "none"}``."""
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: d}


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


def load_named(name: str, base: Path, chain: tuple[str, ...], roots: tuple[Path, ...] = (),
               named_by_user: bool = False, spent: list[int] | None = None) -> tuple[dict[str, Any], str]:
    """The resolved dict of a file or preset, and the file's path; ``spent`` counts the bytes read
    along one ``extends`` chain, which together stay within ``MAX_FILE_BYTES`` (so a chain is as
    bounded as one file)."""
    path, checked = _locate(name, base, roots, named_by_user)
    try:
        key = str(checked or path.resolve())
    except (OSError, RuntimeError) as e:
        raise PolicyError(f"{name}: cannot resolve the path ({e})") from None
    if key in chain:
        cycle = " -> ".join([*chain, key])
        raise PolicyError(f"{path}: extends: cycle ({cycle}); remove one of the `extends`")
    if len(chain) >= MAX_EXTENDS_DEPTH:
        raise PolicyError(f"{path}: extends: more than {MAX_EXTENDS_DEPTH} levels deep")
    spent = [0] if spent is None else spent
    raw = read_file(path, limit=MAX_FILE_BYTES - spent[0], spent=spent, checked=checked)
    return _resolve(raw, None, str(path), path.parent, (*chain, key), roots, spent), str(path)


def _locate(name: str, base: Path, roots: tuple[Path, ...] = (),
            named_by_user: bool = True) -> tuple[Path, Path | None]:
    """The file ``name`` stands for, and for an ``extends`` path the real path that was checked.

    One the user named directly may be anywhere; one named by ``extends`` must be a preset or lie
    inside ``base``'s tree (or an opted-in root), and is then read only at that checked real path.
    """
    names = preset_names()
    looks_like_path = any(sep in name for sep in "/\\") or Path(name).suffix in FORMATS
    if not looks_like_path and name in names:
        return preset_path(name), None
    try:
        path = Path(name) if Path(name).is_absolute() else base / name
        checked = None if named_by_user else _check_inside(name, path, base, roots)
        found, exists = path.is_file(), os.path.lexists(path)
    except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python 3.11)
        raise PolicyError(f"{short(name)}: cannot use this path ({getattr(e, 'strerror', None) or e})") from None
    if found:
        return path, checked
    if exists:
        raise PolicyError(f"{short(name)}: not a regular file (a directory, device, pipe or broken link); "
                          f"name a policy file")
    if looks_like_path:
        raise PolicyError(f"{name}: no such file (looked in {base})")
    h = hint(name, names)
    tail = f"did you mean '{h}'?" if h else f"presets: {', '.join(names)}"
    raise PolicyError(f"{short(name)}: not a policy file and not a preset ({tail})")


def _check_inside(name: str, path: Path, base: Path, roots: tuple[Path, ...]) -> Path:
    """The real path of ``path`` (symlinks followed); refuse an ``extends`` path outside the naming
    file's tree or the opted-in roots, and any path into a pseudo-filesystem (/proc, /sys, /dev)."""
    real = path.resolve()
    if real.parts[:2] in PSEUDO_FS:
        raise PolicyError(f"{short(name)}: extends may not read {real.parts[1]} files")
    trees = (base.resolve(), *roots)
    if not any(real == t or t in real.parents for t in trees):
        where = ("an absolute path" if Path(name).is_absolute()
                 else "outside the directory tree of the file that names it")
        raise PolicyError(f"{short(name)}: extends names {where} (after following links); use a preset name or a "
                          f"path inside {base}, or opt that directory in: unimp.load(..., extends_roots=[dir]) "
                          f"or {EXTENDS_ROOTS_ENV}=dir")
    return real


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_WALK = bool(_NOFOLLOW) and os.open in os.supports_dir_fd and hasattr(os, "O_DIRECTORY")


def _open_checked(real: Path, flags: int) -> int:
    """Open the file at the checked real path ``real`` itself: no link is followed on the way.

    Each directory of ``real`` (which has no links: it was resolved) is opened relative to the
    last with ``O_NOFOLLOW``, so a link swapped in after the check fails (ELOOP/ENOTDIR) instead
    of leading elsewhere. Where ``dir_fd`` is missing, the opened file's (st_dev, st_ino) must be
    the checked path's.
    """
    if not _WALK:
        before = os.stat(real, follow_symlinks=False)
        fd = os.open(real, flags | _NOFOLLOW)
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
            os.close(fd)
            raise OSError(errno.ELOOP, "the file changed after it was checked")
        return fd
    # O_PATH (Linux): a directory one may search but not list is walked as opening it by name would
    dir_flags = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(real.anchor, dir_flags)
    try:
        for part in real.parts[1:-1]:
            inner = os.open(part, dir_flags, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(real.name, flags | _NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def read_file(path: Path, limit: int = MAX_FILE_BYTES, spent: list[int] | None = None,
              checked: Path | None = None, merge_keys: bool = False) -> Any:
    """Parse a TOML/YAML/JSON file into plain data; every failure is a located PolicyError.

    At most ``limit`` bytes are read, whatever the file claims its size is (``/proc`` files say 0).
    ``checked``: the real path an ``extends`` check accepted; the file is opened there and only
    there (a link swapped in after the check is refused, not followed).
    """
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise PolicyError(f"{path}: unknown file type {short(path.suffix)} (use .toml, .yaml, .yml or .json)")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
    try:  # non-blocking open + fstat: a pipe or device swapped in after the check cannot hang the read
        fd = os.open(path, flags) if checked is None else _open_checked(checked, flags)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise PolicyError(f"{path}: not a regular file; name a policy file")
            data = f.read(max(limit, 0) + 1)
    except OSError as e:
        if checked is not None and e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            raise PolicyError(f"{path}: changed after extends checked it (a link or file was swapped in); "
                              f"extends reads only {checked}") from None
        raise PolicyError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > limit:
        whole = "" if limit == MAX_FILE_BYTES else " (with the files it extends)"
        raise PolicyError(f"{path}: over {limit} bytes; a policy file{whole} is at most {MAX_FILE_BYTES} bytes")
    if spent is not None:
        spent[0] += len(data)
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is fine
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    try:
        return parse_text(text, fmt, merge_keys)
    except PolicyError as e:
        raise PolicyError(f"{path}: {e}") from None


def parse_text(text: str, fmt: str, merge_keys: bool = False) -> Any:
    """Parse policy text of one format (``toml`` | ``yaml`` | ``json``); duplicate keys are refused;
    ``merge_keys``: YAML merge keys (``<<:``) are read (another system's file), else refused."""
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        if fmt == "toml":
            deep = _DEEP_KEY.search(text)  # a key starts a line, or follows [ { or ,
            if deep:
                line = text.count("\n", 0, deep.start()) + 1
                raise PolicyError(f"line {line}: a dotted key of more than {MAX_KEY_PARTS} parts; policy keys "
                                  f"are at most 2 deep (e.g. loss_scale.initial)")
            return tomllib.loads(text)
        if fmt == "json":
            return json.loads(text, object_pairs_hook=_json_table)
        return _yaml_load(text, merge_keys)
    except PolicyError:
        raise
    except RecursionError:
        raise PolicyError(f"not valid {fmt.upper()}: nested too deeply") from None
    except Exception as e:  # parser errors of three libraries; message kept, no traceback
        raise PolicyError(f"not valid {fmt.upper()}: {_parser_message(e)}") from None


def _parser_message(e: Exception) -> str:
    """One line from a parser's error, keeping line and column (YAML puts them on a later line)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        context = getattr(e, "context", None)
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _json_table(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise PolicyError(f"duplicate key {short(key)} in one table (JSON would keep only the last one); "
                              f"remove one of them")
        out[key] = value
    return out


@functools.cache
def _yaml_loader(merge: bool = False) -> type:
    """PyYAML's safe loader that refuses duplicate keys and merge keys (``<<``: an alias bomb's tool);
    ``merge``: merge keys are read as YAML 1.1 defines them (another system's file, e.g. an Accelerate
    config, may use them), each merged mapping bounded to ``MAX_MERGED`` pairs so that aliases
    cannot multiply it."""
    import yaml
    from yaml.constructor import ConstructorError

    tag = "tag:yaml.org,2002:merge"

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
        def flatten_mapping(self, node: Any) -> None:
            if merge:
                super().flatten_mapping(node)
                if len(node.value) > MAX_MERGED:
                    raise ConstructorError(None, None, f"merge keys (<<) build a mapping of over {MAX_MERGED} "
                                                       f"entries; write the keys out", node.start_mark)
                return
            for key_node, _ in node.value:
                if key_node.tag == tag:
                    raise ConstructorError(None, None, "merge keys (<<) are not supported in policy files; "
                                                       "use `extends`", key_node.start_mark)

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            own = [k for k, _ in node.value if k.tag != tag]  # a merged key the mapping sets again is no duplicate
            self.flatten_mapping(node)
            seen: set[Any] = set()
            for key_node in own:
                key = self.construct_object(key_node, deep=deep)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:
                    continue  # unhashable: the base constructor refuses it
                if dup:
                    raise ConstructorError(None, None, f"duplicate key {short(key)} (YAML would keep only the "
                                                       f"last one); remove one of them", key_node.start_mark)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
            return mapping

    Loader.add_constructor("tag:yaml.org,2002:map", Loader.construct_yaml_map)
    return Loader


MAX_MERGED = 20_000  # entries of one mapping built with merge keys (a real config's mapping holds a few dozen)


def _yaml_load(text: str, merge: bool = False) -> Any:
    import yaml

    return yaml.load(text, Loader=_yaml_loader(merge))


def _plain(d: Any) -> Any:
    """``d`` with +inf as the string "inf" (JSON has no infinity; :func:`load` reads "inf" back)."""
    if isinstance(d, dict):
        return {k: _plain(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_plain(v) for v in d]
    return "inf" if isinstance(d, float) and math.isinf(d) and d > 0 else d


def to_text(d: dict[str, Any], fmt: str = "toml") -> str:
    """A resolved policy dict as TOML, YAML or JSON text (loads back to the same policy)."""
    if fmt == "toml":
        import tomli_w

        return tomli_w.dumps(d)
    if fmt == "json":
        return json.dumps(_plain(d), indent=2, allow_nan=False)
    if fmt == "yaml":
        import yaml

        return yaml.safe_dump(d, sort_keys=False)
    raise PolicyError(f"<argument>: format {short(fmt)} is not one of toml, yaml, json")
