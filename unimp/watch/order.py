"""Where the first non-finite value of a step appeared: the ordering of a step's checked tensors.

A backend hands over one :class:`Event` per checked tensor (a layer's input/output in the forward, the
scaled loss, the gradients in the backward), each with its position in execution order and whether it
was finite; :func:`first_nonfinite` picks the first non-finite one.

>>> events = [Event("fc1", "output", 0, True), Event("fc2", "output", 1, False), Event("<loss>", "loss", 0, False),
...           Event("fc2", "grad_output", 0, False), Event("fc1", "grad_param", None, False)]
>>> first_nonfinite(events).describe()
'forward: the output of fc2'
>>> first_nonfinite([Event("fc2", "grad_param", None, False), Event("fc1", "grad_param", None, False)],
...                 backward_order=["fc2", "fc1"]).describe()
'backward: a parameter gradient of fc2 (from parameter gradients only)'
>>> first_nonfinite([Event("fc1", "output", 0, True), Event("fc2", "output", 1, True),  # a traced backward
...                  Event("fc1", "grad_output", None, False), Event("fc2", "grad_output", None, False)]).path
'fc2'
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from unimp.watch.records import Origin, direction_of

PASSES = {"forward": 0, "loss": 1, "backward": 2}  # the order a step runs them in


@dataclass(frozen=True)
class Event:
    """One checked tensor of a step: the layer's path, where the tensor is (:data:`unimp.watch.records.TENSORS`),
    its position in execution order within its pass (a layer's output in the forward: in the order the
    layers return; a gradient in the backward: in the order gradients arrive; ``None`` where the backend
    has none, e.g. a parameter gradient read after the backward) and whether all its values were finite."""

    path: str
    tensor: str
    position: float | None
    finite: bool


def first_nonfinite(events: Iterable[Event], backward_order: Sequence[str] = ()) -> Origin | None:
    """The first non-finite event of a step in execution order, as an :class:`Origin` (``None``: all finite).

    - The forward comes first (layers in the order they return: a layer inside another returns before
      it), then the loss, then the backward (in gradient-arrival order). A non-finite value makes what
      is computed from it non-finite, so the first one in this order is where it appeared.
    - A gradient without a position (measured where the backend cannot see the order gradients arrive
      in: a traced backward) takes its layer's forward position mirrored: a gradient arrives at the
      layers' outputs in the reverse order of their returns and leaves their inputs in the reverse order
      of their calls (exact for layers that run one after another or inside one another).
    - A parameter gradient has no position of its own (it is read after the backward): it belongs to its
      layer's backward, right after the gradient arrived at the layer's output and before the gradients
      the layer produced for its inputs.
    - Where a layer has no positioned backward event on that step (no per-layer hooks ran),
      its parameter gradients are ordered by ``backward_order`` (layer paths in gradient-arrival order,
      e.g. as a previous step saw them), after every positioned event, and the origin is not ``exact``.
    """
    events = _mirrored(list(events))
    arrival = {e.path: e.position for e in events if e.tensor == "grad_output" and e.position is not None}
    rank = {path: i for i, path in enumerate(backward_order)}
    best, best_key = None, None
    for e in events:
        if e.finite:
            continue
        position, exact = e.position, True
        if e.tensor == "grad_param" and position is None:
            if e.path in arrival:
                position = arrival[e.path] + 0.5
            else:
                exact = False
        tier = 0 if position is not None or e.tensor == "loss" else 1
        key = (PASSES[direction_of(e.tensor)], tier, position if position is not None else rank.get(e.path, math.inf))
        if best_key is None or key < best_key:
            best, best_key = Origin(e.path, e.tensor, exact), key
    return best


MIRROR = {"grad_output": "output", "grad_input": "input", "fp8_grad_output": "output"}


def _mirrored(events: list[Event]) -> list[Event]:
    """``events`` with unpositioned gradients placed at their layer's mirrored forward position."""
    forward = {(e.path, e.tensor): e.position for e in events
               if e.position is not None and direction_of(e.tensor) == "forward"}
    if not forward:
        return events
    end = max(forward.values()) + 1
    out = []
    for e in events:
        mirror = forward.get((e.path, MIRROR.get(e.tensor, "")))
        out.append(Event(e.path, e.tensor, end + (end - mirror), e.finite)
                   if e.position is None and mirror is not None else e)
    return out
