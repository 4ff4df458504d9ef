"""The Plan's tables: one row per canonical op (:class:`OpDecision`) and per model layer (:class:`LayerRow`),
the model index a backend gives (:class:`LayerInfo`), and the per-layer table and layout findings compiled
from that index (:func:`compile_layers`, :func:`compile_layout`).

>>> import unimp
>>> rows = compile_layers(unimp.load("mixed_bf16"), "bfloat16", [LayerInfo("fc", "linear", ("Dense",))])
>>> rows[0].decision.compute_dtype, OpDecision("softmax", "float32", "float32", "op").runs_in
('bfloat16', 'float32')
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from unimp.plan.layout import LayoutFindings
from unimp.policy import LayerDecision, Policy

CONTROL_LEVELS = ("op", "layer", "fixed")


@dataclass(frozen=True)
class OpDecision:
    """One canonical op in one backend.

    ``requested``: the policy's category; ``dtype``: the dtype it will run in (None = follows its
    inputs); ``control``: op | layer | fixed; ``honoured``: False when the backend falls back.
    """

    op: str
    requested: str
    dtype: str | None
    control: str
    native: tuple[str, ...] = ()
    honoured: bool = True
    note: str = ""

    @property
    def runs_in(self) -> str:
        """The dtype, or how it is chosen: ``widest input`` (promote) or ``inputs``."""
        return self.dtype or ("widest input" if self.requested == "promote" else "inputs")


@dataclass(frozen=True)
class LayerInfo:
    """One layer of a model as its backend indexes it (plain data, no framework objects).

    ``kind``: its canonical op (None: follows its inputs); ``type_names``: its class and bases, most
    specific first (overrides match them); ``dims``: the tiling dims the alignment check reads.
    """

    path: str
    kind: str | None
    type_names: tuple[str, ...] = ()
    dims: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class LayerRow:
    """One row of the Plan's per-layer decision table."""

    path: str
    kind: str | None
    type_names: tuple[str, ...]
    decision: LayerDecision
    ambiguous: tuple[int, ...] = ()  # every matching override, when they disagree (the first wins)


def compile_layers(policy: Policy, compute_dtype: str, index: Iterable[LayerInfo]) -> tuple[LayerRow, ...]:
    """The per-layer decision table: each layer's decision with the resolved compute dtype, and the
    overrides that match it when they disagree (ambiguous: the first one wins, the Plan says so)."""
    rows = []
    for info in index:
        decision = policy.decide(info.path, info.kind, info.type_names, compute_dtype)
        names = (*info.type_names, *((info.kind,) if info.kind else ()))
        hits = policy.overrides_matching(info.path, names)
        results = {(policy.overrides[i].compute_dtype, policy.overrides[i].param_dtype) for i in hits}
        rows.append(LayerRow(info.path, info.kind, tuple(info.type_names), decision,
                             hits if len(results) > 1 else ()))
    return tuple(rows)


def compile_layout(policy: Policy, index: Iterable[LayerInfo]) -> LayoutFindings:
    """Dims of the indexed layers that are not a multiple of ``layout.align``, with the policy's action."""
    return LayoutFindings.check(((i.path, i.dims) for i in index), policy.layout)
