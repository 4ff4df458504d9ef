"""Which objects have a policy applied: ``apply`` refuses a second one until ``amp.remove()``.

Objects are held by identity through weak references that drop their entry when the object is
collected, so a model is never kept alive by unimp (an entry is keyed by ``id``, never by ``==``:
frameworks' modules may compare by value). An object that takes no weak reference is held until
``release``.

Threads, interrupts and the garbage collector, without a lock anyone waits on:

* :func:`claim` marks a model with one ``dict.setdefault`` (atomic): of two threads applying to one
  model exactly one gets the mark, the other :class:`~unimp.errors.AlreadyAppliedError`.
* The weak references' callbacks (run by the collector, in any thread, at any allocation) only
  remove their own entry.
* The marks one ``unimp.apply`` makes in a thread (its claim, and the backend's ``amp.bind_also``)
  are written to that apply's :class:`Journal` before they are set, so an apply that fails anywhere,
  ``KeyboardInterrupt`` included, removes exactly them (:meth:`Journal.rollback`).

>>> class Model: ...
>>> m = Model()
>>> ids = remember(m)
>>> is_applied(m), is_applied(Model())
(True, False)
>>> release(ids); is_applied(m)
False
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from unimp.errors import AlreadyAppliedError

_applied: dict[int, Any] = {}  # id -> weakref.ref to the object (or the object itself if unweakrefable)
_local = threading.local()  # .journal: the Journal of the apply running in this thread, if any
# taken only by claim() around two dict operations on an entry whose object is gone (no finalizer takes it)
_stale = threading.Lock()


def _forget(i: int, entry: Any) -> None:
    if _applied.get(i) is entry:
        del _applied[i]


def _entry(obj: Any) -> Any:
    i = id(obj)
    try:
        return weakref.ref(obj, lambda ref: _forget(i, ref))
    except TypeError:
        return obj


def _held(entry: Any) -> Any:
    """The object an entry marks (None once a weakly held object is gone)."""
    return entry() if isinstance(entry, weakref.ref) else entry


def _journal(i: int, entry: Any) -> None:
    journal = getattr(_local, "journal", None)
    if journal is not None:
        journal.marks.append((i, entry))


class Journal:
    """The marks made in this thread while it is open (one ``unimp.apply``), for :meth:`rollback`.

    >>> class Model: ...
    >>> m, journal = Model(), Journal()
    >>> journal.open(); claim(m); journal.close()
    >>> is_applied(m), journal.rollback(), is_applied(m)
    (True, None, False)
    """

    def __init__(self) -> None:
        self.marks: list[tuple[int, Any]] = []
        self.previous: Journal | None = None

    def open(self) -> None:
        self.previous = getattr(_local, "journal", None)
        _local.journal = self

    def close(self) -> None:
        """Stop journaling (idempotent; a mark made later belongs to the enclosing journal, if any)."""
        if getattr(_local, "journal", None) is self:
            _local.journal = self.previous

    def rollback(self) -> None:
        """Close, and remove every mark this journal wrote that is still there."""
        self.close()
        for i, entry in self.marks:
            _forget(i, entry)


def already_applied(model: Any) -> AlreadyAppliedError:
    """The error of ``unimp.apply`` on a model that has a policy applied (or one being applied or removed)."""
    return AlreadyAppliedError(
        f"unimp.apply: this {type(model).__name__} (id 0x{id(model):x}) already has a unimp policy applied; "
        f"call amp.remove() first, or keep using the Amp you have (another thread applying to or removing "
        f"from this model at the same time gets this error too: apply and remove one model in one thread)")


def claim(model: Any) -> None:
    """Mark ``model`` applied unless it is (atomically: one wins a race); :class:`AlreadyAppliedError` otherwise."""
    i, entry = id(model), _entry(model)
    _journal(i, entry)  # before it is set: an interrupt in between leaves nothing the rollback misses
    while (held := _applied.setdefault(i, entry)) is not entry:
        if _held(held) is not None:  # a live object with this id: the model itself
            raise already_applied(model)
        with _stale:  # a collected object's entry whose callback has not run yet: removed once, by one thread
            _forget(i, held)


def remember(*models: Any) -> list[int]:
    """Mark ``models`` (``None`` skipped) as applied; their ids, for :func:`release`."""
    for m in models:
        if m is None:
            continue
        entry = _entry(m)
        _journal(id(m), entry)
        _applied[id(m)] = entry
    return [id(m) for m in models if m is not None]


def release(ids: list[int]) -> None:
    """Forget the objects an Amp was applied to (called by ``Amp.remove``)."""
    for i in ids:
        _applied.pop(i, None)


def any_applied(ids: list[int]) -> bool:
    """Whether some object of ``ids`` (an Amp's marks) is still marked applied."""
    return any(_held(_applied.get(i)) is not None for i in ids)


def is_applied(model: Any) -> bool:
    """Whether ``model`` has a policy applied that was not removed."""
    return _held(_applied.get(id(model))) is model
