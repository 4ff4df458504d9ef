"""Numerics insight: per-layer, per-step statistics of a training run, and where a skipped step's first
non-finite value appeared. Framework-free: a backend measures, this package records and orders.

``amp.watch(every=100, path="numerics.jsonl")`` returns a :class:`Watch`; each sampled step gives
one record (a plain dict, one JSON line) with, per layer, the largest finite magnitude of its output
and of the gradient arriving at it and the fractions of their values that are non-finite, overflow,
underflow, are subnormal or zero in the layer's compute dtype (:func:`unimp.dtypes.limits`); a skipped
step's record names the layer and pass where its first non-finite value appeared
(:func:`unimp.watch.order.first_nonfinite`). ``amp.report().numerics`` folds them per layer.

>>> from unimp.watch import Watch
>>> w = Watch(every=100)
>>> w.bind(start_step=0, stop=lambda: None)
>>> r = w.add(5, skipped=True, scale=65536.0, sampled=False,
...           events=[("h.0.mlp.c_fc", "output", 3, True), ("h.1.attn.c_attn", "output", 7, False),
...                   ("h.1.attn.c_attn", "grad_output", 2, False)])
>>> r["first_nonfinite"]["path"], r["first_nonfinite"]["direction"]
('h.1.attn.c_attn', 'forward')
"""

from __future__ import annotations

from unimp.watch.order import Event, first_nonfinite
from unimp.watch.records import COUNTS, TENSORS, LayerStats, Origin, StepRecord
from unimp.watch.session import Watch
from unimp.watch.summary import Summary
from unimp.watch.writer import JsonLines, read_records

__all__ = ["COUNTS", "TENSORS", "Event", "JsonLines", "LayerStats", "Origin", "StepRecord", "Summary", "Watch",
           "first_nonfinite", "read_records"]
