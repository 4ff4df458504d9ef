"""The real-configuration corpus the migration tests read: third-party files kept verbatim under
``tests/fixtures/real_configs/<system>/`` with a ``SOURCES.toml`` per system (repository, path,
commit, the lines a user pastes, and the numerics the system runs, each with its citation).

One reader for every test that uses the corpus (the core's facts and round trips, each backend's
replay against the system's real object).

>>> from pathlib import Path
>>> [e["file"] for e in entries(Path("/nonexistent"), "torch")]
[]
"""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path
from typing import Any

from unimp.migrate import import_from
from unimp.migrate.draft import Imported
from unimp.policy.loading import read_file

PARSED = (".yaml", ".yml", ".json", ".toml")  # files passed as files; anything else is pasted text


def entries(root: Path, system: str) -> list[dict[str, Any]]:
    """The ``[[config]]`` entries of ``root/system/SOURCES.toml`` (none when it does not exist)."""
    sources = root / system / "SOURCES.toml"
    if not sources.is_file():
        return []
    data = tomllib.loads(sources.read_text())
    return [dict(c, system=data["system"]) for c in data["config"]]


def pasted(root: Path, entry: dict[str, Any]) -> str:
    """What a user passes to ``unimp import``: the file's path, or the lines they paste from it
    (``lines``: one ``[first, last]`` range or a list of them, 1-based; dedented, ``prefix`` such as
    ``">>> "`` stripped)."""
    path = root / entry["system"] / entry["file"]
    if "lines" not in entry:
        return str(path)
    ranges = entry["lines"] if isinstance(entry["lines"][0], list) else [entry["lines"]]
    every = path.read_text().splitlines()
    prefix = entry.get("prefix", "")
    out: list[str] = []
    for first, last in ranges:
        out += [line.removeprefix(prefix) for line in textwrap.dedent("\n".join(every[first - 1:last])).splitlines()]
    return "\n".join(out)


def imported(root: Path, entry: dict[str, Any]) -> Imported:
    """``unimp import`` of the entry (a config file parsed as the CLI parses it, or the pasted lines)."""
    from unimp.migrate import HJSON

    text = pasted(root, entry)
    parsed = "lines" not in entry and Path(text).suffix in PARSED
    if parsed and entry["system"] in HJSON and Path(text).suffix == ".json":
        text, parsed = Path(text).read_text(), False  # its importer reads it as the system does (hjson)
    raw: Any = read_file(Path(text), merge_keys=True) if parsed else text
    return import_from(entry["system"], raw, source=entry["file"])
