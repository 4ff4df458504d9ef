"""Which objects have a policy applied: ``apply`` refuses a second one until ``amp.remove()``.

Objects are held by identity through weak references that drop their entry when the object is
collected, so a model is never kept alive by unimp (an entry is keyed by ``id``, never by ``==``:
frameworks' modules may compare by value). An object that takes no weak reference is held until
``release``.

>>> class Model: ...
>>> m = Model()
>>> ids = remember(m)
>>> is_applied(m), is_applied(Model())
(True, False)
>>> release(ids); is_applied(m)
False
"""

from __future__ import annotations

import weakref
from typing import Any

_applied: dict[int, Any] = {}  # id -> weakref.ref to the object (or the object itself if unweakrefable)


def _forget(i: int, ref: Any) -> None:
    if _applied.get(i) is ref:
        del _applied[i]


def remember(*models: Any) -> list[int]:
    """Mark ``models`` (``None`` skipped) as applied; their ids, for :func:`release`."""
    for m in models:
        if m is None:
            continue
        i = id(m)
        try:
            _applied[i] = weakref.ref(m, lambda ref, i=i: _forget(i, ref))
        except TypeError:
            _applied[i] = m
    return [id(m) for m in models if m is not None]


def release(ids: list[int]) -> None:
    """Forget the objects an Amp was applied to (called by ``Amp.remove``)."""
    for i in ids:
        _applied.pop(i, None)


def is_applied(model: Any) -> bool:
    """Whether ``model`` has a policy applied that was not removed."""
    held = _applied.get(id(model))
    return (held() if isinstance(held, weakref.ref) else held) is model
