"""The :class:`Watch` handle: what ``amp.watch(...)`` returns, and what a backend reports each recorded step to.

A watch samples every ``every``-th training step (the first step after it starts, then every
``every`` steps): per layer, the statistics of its output and of the gradient arriving at it. A step
the loss scaler skips is recorded too, sampled or not, with where its first non-finite value
appeared (exactly with ``localize=True``, which checks every layer on every step; otherwise from the
parameter gradients the skipped step left, for free). Records are plain dicts, kept in memory (the
last ``keep``) and appended to a JSON-lines file when ``path`` is given.

>>> w = Watch(every=2)
>>> w.bind(start_step=10, stop=lambda: None)
>>> [s for s in range(10, 16) if w.sampled(s)]
[10, 12, 14]
>>> rec = w.add(10, skipped=False, scale=1024.0, sampled=True,
...             layers=[("fc", "output", "float16", 3.5,
...                      {"nonfinite": 0, "overflow": 0, "underflow": 0, "subnormal": 1, "zero": 0, "numel": 4})])
>>> rec["layers"][0]["subnormal"], len(w)
(0.25, 1)
>>> w.close(); w.closed
True
"""

from __future__ import annotations

import os
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from unimp.errors import FileError, UnimpWarning
from unimp.text import printable
from unimp.watch.order import Event, first_nonfinite
from unimp.watch.records import AT_LEAST, COUNTS, LayerStats, StepRecord
from unimp.watch.summary import Summary
from unimp.watch.writer import JsonLines

Writer = Callable[[dict[str, Any]], None]


def _count(name: str, value: Any, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"amp.watch({name}={value!r:.40}): {fix}")
    return value


class Watch:
    """Numerics of a training run under a policy, per layer and step. Made by ``amp.watch(...)``.

    ``every``: sample one step in this many (int >= 1); ``path``: a JSON-lines file the records are
    appended to; ``localize``: check every layer's output and gradients on every step, so that a
    skipped step names the layer and pass where its first non-finite value appeared (costs a small
    reduction per layer and step; without it, a skipped step that is not sampled is located from its
    parameter gradients only); ``keep``: how many records stay in memory (``watch.records``).
    """

    COUNTS, AT_LEAST = COUNTS, AT_LEAST  # the counts a backend measures per tensor (see add)

    def __init__(self, every: int = 100, path: str | os.PathLike[str] | None = None, *, localize: bool = False,
                 keep: int = 1000) -> None:
        self.every = _count("every", every, 1, "sample one step in this many: an int >= 1, e.g. every=100")
        self.keep = _count("keep", keep, 0, "how many records to keep in memory: an int >= 0 (path= has them all)")
        if not isinstance(localize, bool):
            raise ValueError(f"amp.watch(localize={localize!r:.40}): True or False")
        self.localize = localize
        self._records: deque[dict[str, Any]] = deque(maxlen=keep)
        self._writers: list[Writer] = []
        self.path = None
        if path is not None:
            if not isinstance(path, str | os.PathLike):
                raise FileError(f"amp.watch(path={path!r:.40}): a file name (str or path), e.g. 'numerics.jsonl'")
            jsonl = JsonLines(path)
            self.path = jsonl.path
            self._writers.append(jsonl)
        self.summary = Summary()
        self.closed = False
        self._start: int | None = None
        self._stop: Callable[[], None] | None = None

    # ------------------------------------------------------------------ for backends
    def add_writer(self, writer: Writer) -> None:
        """Also hand every record to ``writer`` (a callable; its ``close()``, if any, is called by :meth:`close`)."""
        self._writers.append(writer)

    def bind(self, start_step: int, stop: Callable[[], None]) -> None:
        """The backend starts watching at step ``start_step`` (its next step's index); ``stop`` undoes
        what it installed (called once, by :meth:`close`)."""
        self._start, self._stop = start_step, stop

    def sampled(self, step: int) -> bool:
        """Whether step ``step`` is sampled: the first step watched, then every ``every``-th."""
        return (not self.closed and self._start is not None and step >= self._start
                and (step - self._start) % self.every == 0)

    def add(self, step: int, *, skipped: bool, scale: float | None, sampled: bool,
            layers: Iterable[tuple[str, str, str, float, Mapping[str, float] | Sequence[float]]] = (),
            events: Iterable[tuple[str, str, float | None, bool]] = (),
            backward_order: Sequence[str] = (), notes: Iterable[str] = ()) -> dict[str, Any]:
        """Record one step; returns its record (a plain dict), also handed to every writer.

        ``layers``: ``(path, tensor, dtype, amax, counts)`` per measured tensor, ``counts`` a mapping
        with the keys :attr:`COUNTS` or the sequence :attr:`AT_LEAST` (in ``dtype``, see
        :meth:`unimp.watch.records.LayerStats.from_counts`);
        ``events``: ``(path, tensor, position, finite)`` per checked tensor, ordered by
        :func:`unimp.watch.order.first_nonfinite` (with ``backward_order``) to find where the first
        non-finite value appeared."""
        stats = tuple(LayerStats.from_counts(*layer) for layer in layers)
        origin = first_nonfinite([Event(*e) for e in events], backward_order)
        notes = list(notes)
        if skipped and origin is None and not notes:  # a backend's note says why (another optimizer skipped)
            notes.append("no checked tensor was non-finite: the non-finite value is in a gradient the watch does "
                         "not see (a parameter outside the model, a gradient reduced across devices)")
        record = StepRecord(step, bool(skipped), scale, bool(sampled), stats, origin, tuple(notes))
        self.summary.add(record)
        d = record.to_dict()
        self._records.append(d)
        for write in self._writers:
            try:
                write(d)
            except FileError as e:  # a full disk: training goes on, the watch stops (its file ends whole)
                warnings.warn(f"{e}; the watch stopped at step {step} (its records so far stay in "
                              f"watch.records and the file); training goes on", UnimpWarning, stacklevel=2)
                self.close()
                break
        return d

    # ------------------------------------------------------------------ for users
    @property
    def records(self) -> list[dict[str, Any]]:
        """The recorded steps kept in memory (the last ``keep``), oldest first."""
        return list(self._records)

    @property
    def skipped(self) -> list[dict[str, Any]]:
        """The kept records of skipped steps (each names its first non-finite value in ``first_nonfinite``)."""
        return [r for r in self._records if r["skipped"]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self._records)

    def numerics(self) -> dict[str, Any]:
        """The per-layer summary over every recorded step (``amp.report().numerics``)."""
        return self.summary.to_dict()

    def close(self) -> None:
        """Stop watching: the backend's hooks are removed and the file is closed; the records stay."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._stop is not None:
                self._stop()
        finally:
            for w in self._writers:
                close = getattr(w, "close", None)
                if callable(close):
                    close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "watching"
        return (f"<unimp.Watch every={self.every} localize={self.localize} {state}, {len(self)} records"
                + (f", {printable(str(self.path))}" if self.path else "") + ">")
