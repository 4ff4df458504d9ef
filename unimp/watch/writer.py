"""Records to a JSON-lines file: one step's record per line, flushed as it is written (no TensorBoard needed).

>>> import json, tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "numerics.jsonl"
>>> w = JsonLines(path)
>>> w({"step": 0, "skipped": False}); w.close()
>>> [json.loads(line)["step"] for line in path.read_text().splitlines()]
[0]
>>> read_records(path)[0]["skipped"]
False
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from unimp.watch.records import FRACTIONS

NUMBERS = frozenset({"amax", "scale", *FRACTIONS})  # the float fields of a record (unimp.watch.records)


def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: they are written as the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class JsonLines:
    """Appends each record it is called with to ``path`` as one line of strict JSON (created if missing).

    Each record is written whole or not at all (:class:`unimp.files.AppendLog`): a full disk leaves
    the file ending with the last whole record and raises a :class:`~unimp.errors.FileError` (the
    watch then stops with a warning; training goes on). A target that is not a regular file (a
    FIFO, a device, a directory) is refused at once."""

    def __init__(self, path: str | os.PathLike[str], *, argument: str = "path") -> None:
        from unimp.files import AppendLog, shown

        self._log = AppendLog(path, where=f"amp.watch({argument}={shown(path)!r})")
        self.path = Path(path)

    def __call__(self, record: dict[str, Any]) -> None:
        self._log.append(json.dumps(_finite(record), allow_nan=False) + "\n")

    def close(self) -> None:
        self._log.close()


class ScalarWriter:
    """Records into a TensorBoard-style writer (``torch.utils.tensorboard.SummaryWriter``, VisualDL's
    ``LogWriter``: anything with ``add_scalar(tag, value, step)``, ``add_text(tag, text, step)``, ``flush()``
    and ``close()``): per layer tensor ``numerics/<path>/<tensor>/<stat>`` at the record's step, the scale,
    and a text entry for each skipped step. A backend's ``Amp._tensorboard_writer`` makes the framework's
    writer; the tag layout is this one in every framework."""

    STATS = ("amax", *FRACTIONS)

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def __call__(self, record: dict[str, Any]) -> None:
        step, add = record["step"], self.writer.add_scalar
        if record["scale"] is not None:
            add("numerics/scale", record["scale"], step)
        for s in record["layers"]:
            for stat in self.STATS:
                add(f"numerics/{s['path'] or '<model>'}/{s['tensor']}/{stat}", s[stat], step)
        origin = record["first_nonfinite"]
        if record["skipped"]:
            where = f"{origin['path']} ({origin['direction']}, {origin['tensor']})" if origin else "not found"
            self.writer.add_text("numerics/skipped", f"step {step}: first non-finite value in {where}", step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines file written by :class:`JsonLines` (the numbers written as ``"inf"`` /
    ``"nan"`` strings read back as floats)."""
    def floats(value: Any, key: str = "") -> Any:
        if key in NUMBERS and value in ("inf", "-inf", "nan"):
            return float(value)
        if isinstance(value, dict):
            return {k: floats(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [floats(v) for v in value]
        return value

    with Path(path).open(encoding="utf-8") as f:
        return [floats(json.loads(line)) for line in f if line.strip()]
