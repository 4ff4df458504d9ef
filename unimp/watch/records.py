"""The plain records a watch produces: one per recorded step, JSON-ready.

A :class:`StepRecord` holds the step's per-layer statistics (:class:`LayerStats`, on sampled steps)
and, when a non-finite value appeared, where it appeared first (:class:`Origin`).

>>> s = LayerStats.from_counts("h.0.mlp", "output", "float16", 70000.0,
...                            {"nonfinite": 1, "overflow": 1, "underflow": 0, "subnormal": 2, "zero": 0, "numel": 8})
>>> s.direction, s.overflow, s.subnormal
('forward', 0.125, 0.25)
>>> r = StepRecord(step=3, skipped=True, scale=65536.0, sampled=True, layers=(s,),
...                origin=Origin("h.0.mlp", "output"))
>>> StepRecord.from_dict(r.to_dict()) == r
True
>>> r.origin.describe()
'forward: the output of h.0.mlp'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# the counts a backend measures per tensor, besides amax (see unimp.watch.Watch.add)
COUNTS = ("nonfinite", "overflow", "underflow", "subnormal", "zero", "numel")
FRACTIONS = COUNTS[:-1]
# or, cumulatively: how many magnitudes are non-zero, above dtype's underflow_at, at or above its normal_from,
# at or above its overflow_at, not finite, NaN (unimp.dtypes.Limits), then numel
AT_LEAST = ("nonzero", "above_underflow", "normal", "overflowing", "nonfinite", "nan", "numel")

# where a tensor is, and the direction of the pass that made it
TENSORS = {
    "input": "forward",  # what a layer received (non-finite first here: its parent's own code made it)
    "output": "forward",  # what a layer's forward returned
    "loss": "loss",  # the scaled loss handed to the backward
    "grad_output": "backward",  # the gradient arriving at a layer's output
    "grad_param": "backward",  # a gradient of one of the layer's own parameters
    "grad_input": "backward",  # the gradient a layer's backward produced for its inputs
    "fp8_input": "forward",  # an FP8 layer's input, scaled tensorwise to its forward format
    "fp8_grad_output": "backward",  # an FP8 layer's output gradient, scaled tensorwise to its gradient format
}


def direction_of(tensor: str) -> str:
    """``forward``, ``loss`` or ``backward`` for a tensor place of :data:`TENSORS`."""
    try:
        return TENSORS[tensor]
    except KeyError:
        raise ValueError(f"unknown tensor place {tensor!r}; known: {', '.join(TENSORS)}") from None


@dataclass(frozen=True)
class LayerStats:
    """One tensor of one layer on a sampled step: its largest finite magnitude and the fractions of its
    values that are non-finite, overflow (above ``dtype``'s max: inf once stored in it), underflow (round
    to zero in ``dtype``: seen only where the tensor is wider than it), are subnormal or zero in ``dtype``
    (:func:`unimp.dtypes.limits`). Gradients are measured as they are in the backward: scaled by the
    loss scale of the step."""

    path: str
    tensor: str
    dtype: str
    numel: int
    amax: float
    nonfinite: float
    overflow: float
    underflow: float
    subnormal: float
    zero: float

    @property
    def direction(self) -> str:
        return direction_of(self.tensor)

    @classmethod
    def from_counts(cls, path: str, tensor: str, dtype: str, amax: float,
                    counts: Mapping[str, float] | Sequence[float]) -> LayerStats:
        """From a backend's raw counts: a mapping with the keys :data:`COUNTS`, or the sequence of
        :data:`AT_LEAST` (how many magnitudes reach each class boundary of ``dtype``, then numel: what
        counting on the bit patterns gives); fractions of ``numel`` (0 for an empty tensor).

        >>> s = LayerStats.from_counts("fc", "output", "float16", 1.0, [7, 6, 5, 2, 1, 0, 8])
        >>> s.zero, s.underflow, s.subnormal, s.overflow, s.nonfinite
        (0.125, 0.125, 0.125, 0.25, 0.125)
        """
        direction_of(tensor)
        if not isinstance(counts, Mapping):
            nonzero, above_underflow, normal, overflowing, nonfinite, nan, n = (int(c) for c in counts)
            counts = {"nonfinite": nonfinite, "overflow": overflowing - nan, "underflow": nonzero - above_underflow,
                      "subnormal": above_underflow - normal, "zero": n - nonzero, "numel": n}
        n = int(counts["numel"])
        return cls(path, tensor, dtype, n, float(amax), *(float(counts[f]) / n if n else 0.0 for f in FRACTIONS))

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "direction": self.direction, "tensor": self.tensor, "dtype": self.dtype,
                "numel": self.numel, "amax": self.amax, **{f: getattr(self, f) for f in FRACTIONS}}


@dataclass(frozen=True)
class Origin:
    """Where the first non-finite value of a step appeared: the layer (module path as in ``amp.report()``;
    ``<loss>`` for the loss) and the tensor (:data:`TENSORS`), hence the direction. ``exact`` is False when
    only the parameter gradients were there to look at (no per-layer flags on that step): then it is the
    first layer, in gradient-arrival order, whose own parameter gradients are not finite."""

    path: str
    tensor: str
    exact: bool = True

    @property
    def direction(self) -> str:
        return direction_of(self.tensor)

    def describe(self) -> str:
        what = {"input": "the input of", "output": "the output of", "loss": "the scaled loss",
                "grad_output": "the gradient arriving at the output of", "grad_param": "a parameter gradient of",
                "grad_input": "the input gradient produced by", "fp8_input": "the FP8 input of",
                "fp8_grad_output": "the FP8 output gradient of"}[self.tensor]
        where = (f"{what} (non-finite before the backward: in the forward, or in a loss computed outside the "
                 f"model; localize=True names the layer)") if self.tensor == "loss" else f"{what} {self.path}"
        return f"{self.direction}: {where}" + ("" if self.exact else " (from parameter gradients only)")

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "direction": self.direction, "tensor": self.tensor, "exact": self.exact}


@dataclass(frozen=True)
class StepRecord:
    """One recorded step: ``sampled`` (per-layer statistics taken) and/or ``skipped`` (the loss scaler
    skipped it: ``origin`` says where its first non-finite value appeared). ``scale``: the loss scale the
    step's gradients were scaled by."""

    step: int
    skipped: bool
    scale: float | None
    sampled: bool
    layers: tuple[LayerStats, ...] = ()
    origin: Origin | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """The plain dict (one JSON line)."""
        return {"step": self.step, "skipped": self.skipped, "scale": self.scale, "sampled": self.sampled,
                "first_nonfinite": self.origin.to_dict() if self.origin else None,
                "layers": [s.to_dict() for s in self.layers], "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepRecord:
        o = d.get("first_nonfinite")
        layers = tuple(LayerStats(**{k: v for k, v in s.items() if k != "direction"}) for s in d.get("layers", ()))
        return cls(step=d["step"], skipped=d["skipped"], scale=d["scale"], sampled=d["sampled"], layers=layers,
                   origin=Origin(o["path"], o["tensor"], o["exact"]) if o else None, notes=tuple(d.get("notes", ())))
