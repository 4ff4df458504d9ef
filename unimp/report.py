"""What actually ran: one row per layer/op path, diffable as JSON.

>>> r = Report([ReportRow("fc", "linear", "bfloat16", "float32", "bfloat16")], backend="torch")
>>> Report.from_json(r.to_json()).rows[0].compute_dtype
'bfloat16'
>>> r.diff(r)
[]
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from unimp.text import printable, printable_lines


@dataclass(frozen=True)
class ReportRow:
    """One layer (or op) as observed in a real forward."""

    path: str
    kind: str | None
    compute_dtype: str | None
    param_dtype: str | None
    output_dtype: str | None
    fp8: str | None = None  # the FP8 recipe the layer ran (unimp.plan.fp8), None = not FP8


class RowTable:
    """A dataclass holding one row per layer (``rows``, each with a ``path``): :class:`Report` and the tuner's
    ``Sensitivity``."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # each subclass is a dataclass
    rows: Sequence[Any]

    def row(self, path: str) -> Any:
        for r in self.rows:
            if r.path == path:
                return r
        raise KeyError(path)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = [asdict(r) for r in self.rows]
        return d


@dataclass
class Report(RowTable):
    """Rows plus loss-scale counters; ``print(report)`` shows a table."""

    rows: list[ReportRow]
    backend: str = ""
    policy: str = ""
    fingerprint: str = ""
    scale: float | None = None
    skipped_steps: int = 0
    steps: int = 0
    notes: list[str] = field(default_factory=list)
    # per layer tensor over a watch's recorded steps (unimp.watch.Summary), when amp.watch() ran
    numerics: dict[str, Any] | None = None


    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Report:
        d = json.loads(text)
        d["rows"] = [ReportRow(**r) for r in d["rows"]]
        return cls(**d)

    def diff(self, other: Report) -> list[str]:
        """Human-readable differences in rows (by path) and counters."""
        out = []
        mine, theirs = {r.path: r for r in self.rows}, {r.path: r for r in other.rows}
        for path in [*mine, *(p for p in theirs if p not in mine)]:
            a, b = mine.get(path), theirs.get(path)
            if a is None or b is None:
                out.append(f"{path}: only in {'other' if a is None else 'self'}")
                continue
            for f in ("kind", "compute_dtype", "param_dtype", "output_dtype", "fp8"):
                if getattr(a, f) != getattr(b, f):
                    out.append(f"{path}: {f} {getattr(a, f)} != {getattr(b, f)}")
        for f in ("scale", "skipped_steps", "steps"):
            if getattr(self, f) != getattr(other, f):
                out.append(f"{f}: {getattr(self, f)} != {getattr(other, f)}")
        return out

    def __str__(self) -> str:
        fp8 = any(r.fp8 for r in self.rows)  # the column shows where some layer ran FP8
        return format_table(
            ("path", "kind", "compute", "params", "output", *(("fp8",) if fp8 else ())),
            [(r.path or "<model>", r.kind or "-", r.compute_dtype or "-", r.param_dtype or "-",
              r.output_dtype or "-", *((r.fp8 or "-",) if fp8 else ())) for r in self.rows],
            title=f"unimp report: {self.backend} / policy {self.policy!r} ({self.fingerprint})",
            footer=[f"loss scale {self.scale}, skipped {self.skipped_steps} of {self.steps} steps",
                    *self.notes, *numerics_view(self.numerics)])


NUMERICS_COLUMNS = ("amax_max", "nonfinite_max", "overflow_max", "underflow_max", "subnormal_max", "zero_max")


def numerics_view(numerics: dict[str, Any] | None) -> list[str]:
    """The printed numerics section of a report (empty without a watch): per layer tensor the largest amax
    and the worst fractions over the sampled steps, then the skipped steps and their first non-finite value."""
    if not numerics:
        return []
    n = numerics
    table = format_table(
        ("path", "tensor", "dtype", "steps", "amax", "nonfinite", "overflow", "underflow", "subnormal", "zero"),
        [(r["path"] or "<model>", r["tensor"], r["dtype"], str(r["steps"]),
          *(f"{r[c]:.4g}" for c in NUMERICS_COLUMNS)) for r in n["layers"]],
        title=f"numerics: {n['sampled_steps']} sampled steps (worst over them), {n['skipped_steps']} skipped")
    return ["", table, *(f"skipped step {s['step']}: first non-finite value in {s['first_nonfinite']}"
                         for s in n["skipped"])]


def format_table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]], title: str = "",
                 footer: Iterable[str] = ()) -> str:
    """A plain-text table; every cell, the title and the footer lines printable (:func:`unimp.text.printable`:
    a module path or key holding a control sequence is shown escaped, never sent to the terminal)."""
    rows = [tuple(printable(str(c)) for c in r) for r in (header, *rows)]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(([printable_lines(title)] if title else []) + lines + [printable_lines(f) for f in footer])
