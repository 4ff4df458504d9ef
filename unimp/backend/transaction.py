"""``unimp.apply`` is all or nothing: a :class:`Snapshot` taken before it, restored if it fails.

A backend names what ``apply`` may change (``Backend.snapshot``): the Python objects whose
attributes it sets (modules, layers, the optimizer) and the values it replaces that live outside
those attribute dicts (a tensor's storage, a variable's value) as ``(get, set)`` pairs. The
snapshot keeps references, never copies of arrays: ``restore()`` puts back every attribute (and
the contents of the dicts and lists it holds, two levels down, in the same container objects),
drops the attributes ``apply`` added, gives each object its class back, and sets each value back
to the object it was. No attribute
is written where nothing changed, so restoring an untouched model changes nothing.

>>> class Layer: ...
>>> layer = Layer(); layer.params = {"w": [1.0, 2.0]}; w = layer.params["w"]
>>> snap = Snapshot([layer])
>>> layer.params["w"] = [0.5]; layer.forward = print; w.append(3.0)
>>> snap.restore()
>>> layer.params["w"] is w, w, hasattr(layer, "forward")
(True, [1.0, 2.0], False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

_DEPTH = 3  # containers restored in place this deep: optimizer.param_groups -> group -> group["params"]


def _copy(value: Any, depth: int) -> Any:
    """``(container, saved contents)`` for a dict or list, recursively; the value itself otherwise."""
    if depth and isinstance(value, dict | list):
        items = list(value.items()) if isinstance(value, dict) else list(value)
        if isinstance(value, dict):
            return _Saved(value, [(k, _copy(v, depth - 1)) for k, v in items])
        return _Saved(value, [_copy(v, depth - 1) for v in items])
    return value


class _Saved:
    """A dict or list and what it held (values saved the same way, ``depth`` levels down)."""

    __slots__ = ("container", "contents")

    def __init__(self, container: Any, contents: list[Any]) -> None:
        self.container = container
        self.contents = contents

    def restore(self) -> Any:
        c = self.container
        if isinstance(c, dict):
            wanted = [(k, _restored(v)) for k, v in self.contents]
            now = list(c.items())
            # by identity only: keys and values may be arrays (torch.optim's state is keyed by parameters)
            if len(now) != len(wanted) or any(k is not j or a is not b
                                              for (k, a), (j, b) in zip(now, wanted, strict=True)):
                c.clear()
                c.update(dict(wanted))
        else:
            wanted = [_restored(v) for v in self.contents]
            if len(c) != len(wanted) or any(a is not b for a, b in zip(c, wanted, strict=True)):
                c[:] = wanted
        return c


def _restored(value: Any) -> Any:
    return value.restore() if isinstance(value, _Saved) else value


class Snapshot:
    """What ``objects`` held (attributes, two levels of dicts/lists in them) and what ``values``
    read, to put back with :meth:`restore`."""

    def __init__(self, objects: Iterable[Any] = (),
                 values: Iterable[tuple[Callable[[], Any], Callable[[Any], None]]] = ()) -> None:
        self.objects: list[tuple[Any, type, dict[str, Any]]] = []
        seen: set[int] = set()
        for obj in objects:
            attrs = getattr(obj, "__dict__", None)
            if attrs is None or id(obj) in seen:
                continue
            seen.add(id(obj))
            self.objects.append((obj, type(obj), {k: _copy(v, _DEPTH) for k, v in attrs.items()}))
        self.values = [(get(), get, put) for get, put in values]

    def restore(self) -> None:
        """Everything back as it was when the snapshot was taken (in the same objects). Every object
        and value is restored even if one fails; the first failure is raised afterwards."""
        errors: list[Exception] = []
        for obj, cls, saved in self.objects:
            try:
                _restore_object(obj, cls, saved)
            except Exception as e:
                errors.append(e)
        for value, _, put in self.values:
            try:
                put(value)
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]


def _restore_object(obj: Any, cls: type, saved: dict[str, Any]) -> None:
    if type(obj) is not cls:  # a backend may give a layer a subclass for the duration
        object.__setattr__(obj, "__class__", cls)
    attrs = obj.__dict__
    for key in [k for k in attrs if k not in saved]:
        del attrs[key]
    for key, value in saved.items():
        value = _restored(value)
        if attrs.get(key, _MISSING) is not value:
            attrs[key] = value


_MISSING = object()


def all_or_nothing(snapshot: Snapshot | Callable[[], Snapshot | None] | None, apply: Callable[[], T],
                   undo: Callable[[], None] | None = None) -> T:
    """``apply()``; if it raises (anything, ``KeyboardInterrupt`` included), ``snapshot`` is restored
    first, then ``undo()`` runs (a failure of either is added to the original error as a note, never
    hides it). ``snapshot`` may be a function taking it: called inside, so what runs before the
    snapshot is taken (``unimp.apply`` claims the model there) is rolled back by ``undo`` too."""
    taken = None
    try:
        taken = snapshot() if callable(snapshot) else snapshot
        return apply()
    except BaseException as error:
        for step, what in ((taken.restore if taken is not None else None, "restoring the model"),
                           (undo, "undoing its bookkeeping")):
            if step is None:
                continue
            try:
                step()
            except Exception as e:  # the original error is what the user needs; this one is attached
                error.add_note(f"unimp: {what} after the failed apply also failed: {e!r}")
        raise
