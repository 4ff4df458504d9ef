"""The numerics view of a report: a watch's records folded per layer tensor, bounded in size.

Per (layer, tensor): how many sampled steps saw it, the largest amax and the worst fraction of each
kind over them; and the skipped steps with where their first non-finite value appeared (the last
:data:`SKIPPED_KEPT`, with the total count).

>>> from unimp.watch.records import LayerStats, Origin, StepRecord
>>> s = Summary()
>>> stats = LayerStats("fc", "output", "float16", 4, 3.0, 0.0, 0.0, 0.0, 0.25, 0.0)
>>> s.add(StepRecord(0, False, 1024.0, True, (stats,)))
>>> s.add(StepRecord(7, True, 1024.0, False, origin=Origin("fc", "output")))
>>> d = s.to_dict()
>>> d["layers"][0]["subnormal_max"], d["skipped"], d["skipped_steps"]
(0.25, [{'step': 7, 'first_nonfinite': 'forward: the output of fc'}], 1)
"""

from __future__ import annotations

from collections import deque
from typing import Any

from unimp.watch.records import FRACTIONS, StepRecord

SKIPPED_KEPT = 100


class Summary:
    """Running per-layer aggregate of a watch's :class:`StepRecord` (what ``report.numerics`` shows)."""

    def __init__(self) -> None:
        self.sampled_steps = 0
        self.skipped_steps = 0
        self._layers: dict[tuple[str, str], dict[str, Any]] = {}
        self._skipped: deque[dict[str, Any]] = deque(maxlen=SKIPPED_KEPT)

    def add(self, record: StepRecord) -> None:
        self.sampled_steps += record.sampled
        if record.skipped:
            self.skipped_steps += 1
            self._skipped.append({"step": record.step, "first_nonfinite":
                                  record.origin.describe() if record.origin else "not found"})
        for s in record.layers:
            row = self._layers.setdefault((s.path, s.tensor), {
                "path": s.path, "direction": s.direction, "tensor": s.tensor, "dtype": s.dtype, "steps": 0,
                "amax_max": 0.0, **{f"{f}_max": 0.0 for f in FRACTIONS}})
            row["steps"] += 1
            row["dtype"] = s.dtype
            row["amax_max"] = max(row["amax_max"], s.amax)
            for f in FRACTIONS:
                row[f"{f}_max"] = max(row[f"{f}_max"], getattr(s, f))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for :class:`unimp.report.Report` (``report.numerics``)."""
        return {"sampled_steps": self.sampled_steps, "skipped_steps": self.skipped_steps,
                "layers": [dict(r) for r in self._layers.values()], "skipped": list(self._skipped)}
