"""The framework-free half of a watch whose taps are traced into a compiled step (``tf.function``, ``jax.jit``):
which tensors a step taps, what each tap measures, and how the host turns one step's measurements into
:meth:`unimp.watch.Watch.add`'s ``layers`` and ``events``.

A tap is made while the step is traced (:meth:`Taps.tap`): its layer path, its place (:data:`TENSORS`), the
dtype it is measured in and, for a forward tensor, its position (the order the taps were traced in, which is
the order the layers ran in; a gradient's is left to :func:`unimp.watch.first_nonfinite`, which mirrors it).
On each run the compiled step hands back, per tap, the largest finite magnitude and the counts
:data:`unimp.watch.records.AT_LEAST`, which a backend counts by comparing magnitudes (float32, or float64 for
a float64 tensor) against :func:`thresholds`; :meth:`Taps.put` keeps them, :meth:`Taps.take` folds a step.

>>> taps = Taps()
>>> out, grad = taps.tap("fc", "output", "float16"), taps.tap("fc", "grad_output", "float16")
>>> taps.put(out, 3.0, [4, 4, 3, 0, 0, 0, 4]); taps.put(grad, 70000.0, [4, 4, 4, 1, 1, 0, 4])
>>> layers, events = taps.take()
>>> [(path, tensor, amax) for path, tensor, _, amax, _ in layers]
[('fc', 'output', 3.0), ('fc', 'grad_output', 70000.0)]
>>> events
[('fc', 'output', 0.0, True), ('fc', 'grad_output', None, False)]
>>> thresholds("float16")[2]  # the float32 magnitude from which a value is inf in float16
65520.0
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from unimp import dtypes
from unimp.watch.records import AT_LEAST, direction_of

NONFINITE = AT_LEAST.index("nonfinite")  # the count a tensor is finite by (0 non-finite values)
FLOAT32_MAX = dtypes.limits("float32").max
EVENTS_ONLY = frozenset({"grad_param"})  # checked for where a non-finite value appeared, not shown per layer
_MIRRORED = {"grad_output": "output", "grad_input": "input"}


def _at_or_above(value: float, compare: str, strict: bool) -> float:
    """The smallest ``compare`` value (``float32``/``float64``) ``>= value`` (``> value`` when ``strict``)."""
    if compare == "float64":
        return math.nextafter(value, math.inf) if strict else value
    if value > FLOAT32_MAX:
        return math.inf
    got: float = struct.unpack("<f", struct.pack("<f", value))[0]  # rounded to nearest
    if got < value or (strict and got == value):
        bits = struct.unpack("<I", struct.pack("<f", got))[0] + 1
        got = struct.unpack("<f", struct.pack("<I", bits))[0]
    return got


def thresholds(target: str, compare: str = "float32") -> tuple[float, float, float, float]:
    """The magnitudes in ``compare`` from which a value counts in the classes of :data:`AT_LEAST` after
    ``nonzero`` (``> 0``) in ``target``: above ``underflow_at``, normal, overflowing, not finite; each
    compared with ``>=``. A NaN compares false: a backend adds its NaN count to each count.

    >>> thresholds("float32")[0], thresholds("bfloat16")[2] == thresholds("bfloat16")[3] == math.inf
    (1.401298464324817e-45, False)
    """
    lim = dtypes.limits(target)
    return (_at_or_above(lim.underflow_at, compare, True),
            _at_or_above(lim.normal_from, compare, False), min(_at_or_above(lim.overflow_at, compare, False), math.inf),
            math.inf)


def measured_in(own: str, compute: str | None) -> str:
    """The dtype a tensor of dtype ``own`` is measured in: its layer's compute dtype (``compute``) where that is
    a 16-bit float and the tensor is wider (a float32 output of a layer that computed in float16), else its own.

    >>> measured_in("float32", "float16"), measured_in("bfloat16", "float16"), measured_in("float32", None)
    ('float16', 'bfloat16', 'float32')
    """
    return compute if compute in ("float16", "bfloat16") and own not in ("float16", "bfloat16") else own


@dataclass
class Tap:
    """One tapped tensor of the step: a layer's ``tensor`` (:data:`TENSORS`), measured in ``dtype``."""

    path: str
    tensor: str
    dtype: str
    position: float | None = None  # a forward tensor's place in the order the taps were traced


class Taps:
    """The taps of a traced step and the measurements its runs hand back (see the module's docstring).

    A tap keeps its index for the watch's life (a step traced again, for new shapes, finds the same
    ones); a layer called twice in a step is one tap, its measurements folded (largest amax, counts summed)."""

    def __init__(self) -> None:
        self.taps: list[Tap] = []
        self._index: dict[tuple[str, str], int] = {}
        self._clock = 0
        self._rows: dict[int, tuple[float, list[int]]] = {}

    def tracing(self) -> None:
        """A step is traced (again): forward positions are numbered from 0."""
        self._clock = 0

    def tap(self, path: str, tensor: str, dtype: str) -> int:
        """The index of the tap of ``path``'s ``tensor`` measured in ``dtype`` (made at its first trace)."""
        key = (path, tensor)
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.taps)
            self.taps.append(Tap(path, tensor, dtype))
        tap = self.taps[index]
        tap.dtype = dtype
        if direction_of(tensor) == "forward" and (tap.position is None or self._clock <= tap.position):
            tap.position = float(self._clock)
            self._clock += 1
        return index

    def put(self, index: int, amax: float, counts: Sequence[int]) -> None:
        """One run's measurement of tap ``index``: its amax and its :data:`AT_LEAST` counts."""
        counts = [int(c) for c in counts]
        had = self._rows.get(index)
        if had is not None:
            amax, counts = max(had[0], amax), [a + b for a, b in zip(had[1], counts, strict=True)]
        self._rows[index] = (float(amax), counts)

    def take(self, measured: bool = True) -> tuple[list[tuple[str, str, str, float, list[int]]],
                                                   list[tuple[str, str, float | None, bool]]]:
        """The step's ``(layers, events)`` for :meth:`unimp.watch.Watch.add` (``layers`` in execution order:
        the forward as the layers returned, then the gradients in the reverse order; empty unless
        ``measured``; a parameter gradient is an event only, as in the other backends' records), and forget
        them for the next step."""
        rows, self._rows = self._rows, {}
        events = [(self.taps[i].path, self.taps[i].tensor, self.taps[i].position, counts[NONFINITE] == 0)
                  for i, (_, counts) in rows.items()]
        if not measured:
            return [], events
        forward = {(t.path, t.tensor): t.position for t in self.taps if t.position is not None}

        def order(i: int) -> tuple[int, float]:
            t = self.taps[i]
            if t.position is not None:
                return 0, t.position
            return 1, -(forward.get((t.path, _MIRRORED.get(t.tensor, "")), 0.0) or 0.0)

        layers = [(self.taps[i].path, self.taps[i].tensor, self.taps[i].dtype, rows[i][0], rows[i][1])
                  for i in sorted(rows, key=order) if self.taps[i].tensor not in EVENTS_ONLY]
        return layers, events
