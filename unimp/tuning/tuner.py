"""Tuning (``unimp.tune``): a policy that keeps the sensitive layers high and lowers the rest, as a reviewable file.

From the sensitivity table (:mod:`unimp.tuning.study`) a layer is kept high when, lowered alone, it
moves the loss by more than ``max_loss_increase`` or the model's outputs by more than rounding to the
format explains (``max_output_divergence``, default :func:`~unimp.tuning.study.rounding_bound`: values lost
to the range, which a model at initialisation may not show in its loss yet), and for FP8 when its GEMMs
measured slower in FP8 than in the compute dtype (``min_speedup``; unused where not measured). The rest
are lowered together, least sensitive first, and the combination is measured against the same limits
(the output limit grown by ``sqrt(layers lowered)``, as independent roundings add up): when it exceeds
them, a binary search over that order finds the longest prefix within them (one run per step: at most
``log2(layers) + 2`` runs). The file comments each added override with its measurements.

>>> budget(0.01), budget(0), budget(math.inf, "max_output_divergence", finite=False)
(0.01, 0.0, inf)
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from unimp.errors import TuneError
from unimp.policy import Policy
from unimp.policy.spec import MAX_ITEMS, show
from unimp.tuning.evaluate import Run, change, divergence
from unimp.tuning.policy_file import preset_of, render
from unimp.tuning.speed import SpeedSearch
from unimp.tuning.study import (
    LayerSensitivity,
    Sensitivity,
    Study,
    percent,
    speedup_text,
)
from unimp.tuning.variants import Candidate, keep_overrides, keeping


@dataclass(frozen=True)
class Kept:
    """A layer the tuned policy keeps high, and why."""

    layer: LayerSensitivity
    reason: str


@dataclass(frozen=True)
class Tuned:
    """The tuned policy, its file text, what was kept and lowered, and its measured loss and outputs."""

    policy: Policy
    text: str
    sensitivity: Sensitivity
    kept: tuple[Kept, ...]
    lowered: tuple[LayerSensitivity, ...]
    loss: float
    change: float
    divergence: float
    output_divergence: float | None
    max_loss_increase: float
    max_output_divergence: float

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the policy file (TOML) to ``path``, whole or not at all (:func:`unimp.files.write_file`: a
        failure is a :class:`~unimp.errors.FileError` and leaves no partial file)."""
        from unimp.files import shown, write_file

        write_file(path, self.text, where=f"Tuned.write({shown(path)!r})")
        return Path(path)

    def __str__(self) -> str:
        s = self.sensitivity
        outputs = (f", output divergence {percent(self.output_divergence, False)}"
                   if self.output_divergence is not None else "")
        return (f"{s}\n\ntuned policy {self.policy.name!r}: {len(self.lowered)} of {len(s.rows)} layers in "
                f"{s.lowered_to}, {len(self.kept)} kept in {s.high}; loss {self.loss:.6g} (divergence "
                f"{percent(self.divergence, False)}{outputs}; max_loss_increase "
                f"{percent(self.max_loss_increase, False)}) against {s.reference_loss:.6g} (all of them in "
                f"{s.high}); {s.evaluations} runs over the batches")


def budget(value: Any, name: str = "max_loss_increase", finite: bool = True) -> float:
    """A relative change >= 0 (finite unless ``finite`` is False), else a :class:`TuneError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0 or (
            finite and math.isinf(value)):
        raise TuneError(f"{name}={show(value)}: expected a {'finite ' if finite else ''}number >= 0 (a relative "
                        f"change: 0.01 = 1%)")
    return float(value)


def _measured(row: LayerSensitivity, target: str, high: str) -> str:
    """One layer's numbers for a comment."""
    outputs = (f", output divergence {percent(row.output_divergence, False)}"
               if row.output_divergence is not None else "")
    speed = (f"; FP8 GEMM speed-up {speedup_text(row.speedup)}"
             + (f" at M x K x N = {'x'.join(map(str, row.shape))}" if row.shape and row.speedup else "")
             if target == "fp8" else "")
    hessian = f"; Hessian trace {row.hessian_trace:.4g}" if row.hessian_trace is not None else ""
    return (f"{row.lowered_to} alone: loss {row.loss:.6g} ({percent(row.change)}), divergence "
            f"{percent(row.divergence, False)}{outputs} against {high}{speed}{hessian}")


@dataclass(frozen=True)
class Limits:
    """How far the loss (``loss``) and, where recorded, the outputs (``outputs``, per lowered layer) may move."""

    loss: float
    outputs: float

    def exceeded(self, loss: float, outputs: float | None, layers: int = 1) -> str | None:
        """The limits a measurement with ``layers`` lowered layers exceeds (a phrase), or None."""
        over = []
        if loss > self.loss:
            over.append(f"divergence {percent(loss, False)} > max_loss_increase {percent(self.loss, False)}")
        bound = self.outputs * math.sqrt(max(layers, 1))
        if outputs is not None and outputs > bound:
            over.append(f"output divergence {percent(outputs, False)} > {percent(bound, False)} (more than rounding "
                        f"explains: values lost to the range)")
        return " and ".join(over) or None


class _Search:
    """Tuned policies by how many of the ordered layers they lower, each measured once."""

    def __init__(self, study: Study, table: Sensitivity, order: Sequence[LayerSensitivity], always_kept: Sequence[str],
                 limits: Limits) -> None:
        self.study, self.order, self.limits = study, order, limits
        self.by_path = {c.path: c for c in study.candidates}
        self.rank = {r.path: i for i, r in enumerate(table.rows)}  # kept layers are listed most sensitive first
        self.always_kept = list(always_kept)
        self.runs: dict[int, Run] = {0: study.ref}  # lowering none of them is the reference

    def kept(self, k: int) -> list[Candidate]:
        """The layers kept when the first ``k`` of the order are lowered, most sensitive first."""
        return self.candidates([*self.always_kept, *(r.path for r in self.order[k:])])

    def candidates(self, paths: Sequence[str]) -> list[Candidate]:
        """The candidates at ``paths``, most sensitive first."""
        return [self.by_path[p] for p in sorted(paths, key=self.rank.__getitem__)]

    def policy(self, k: int) -> Policy:
        return self.keeping(self.kept(k))

    def keeping(self, kept: Sequence[Candidate]) -> Policy:
        """The tuned policy keeping ``kept`` high."""
        s = self.study
        return keeping(s.policy, s.target, kept, name=f"{s.policy.name[:200]}-tuned")

    def run(self, k: int) -> Run:
        if k not in self.runs:
            self.runs[k] = self.study.run(self.policy(k))
        return self.runs[k]

    def fails(self, k: int) -> str | None:
        run = self.run(k)
        return self.limits.exceeded(divergence(self.study.ref.losses, run.losses), run.output_divergence, k)

    def longest(self) -> int:
        """The largest k whose policy stays within the limits (binary search: lowering more never helps)."""
        n = len(self.order)
        if not self.fails(n):
            return n
        lo, hi = 0, n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if not self.fails(mid) else (lo, mid)
        return lo


def choose(study: Study, table: Sensitivity, limit: float, outputs: float | None, fastest: float,
           speed: str | None = None) -> Tuned:
    """The tuned policy from a study's table: the layers over the limits alone (and, for FP8, those slower than
    ``fastest``) kept high, then the longest least-sensitive-first set of the rest within the limits lowered.
    ``outputs``: the per-layer output limit (None: what rounding explains, :attr:`Sensitivity.rounding`).
    ``speed`` ``"compiled"``/``"eager"`` (FP8): of that set, the layers in FP8 are those of the fastest whole
    training step measured (:mod:`unimp.tuning.speed`); the rest stay in the compute dtype."""
    limits = Limits(limit, table.rounding if outputs is None else outputs)
    reasons: dict[str, str] = {}
    for r in table.rows:
        over = limits.exceeded(r.divergence, r.output_divergence)
        if over:
            reasons[r.path] = f"kept in {study.high}: alone, {over}"
        elif study.target == "fp8" and r.speedup is not None and r.speedup < fastest:
            reasons[r.path] = (f"kept in {study.high}: slower in FP8 on this device ({speedup_text(r.speedup)} < "
                               f"min_speedup {fastest:g}x)")
    order = sorted((r for r in table.rows if r.path not in reasons),
                   key=lambda r: (r.divergence, r.output_divergence or 0.0, r.path))
    search = _Search(study, table, order, [r.path for r in table.rows if r.path in reasons], limits)
    k = search.longest()
    for r in order[k:]:
        reasons[r.path] = (f"kept in {study.high}: within the limits alone, but lowered with the {k} less sensitive "
                           f"layers: {search.fails(k + 1)}")
    steps: SpeedSearch | None = None
    if study.target == "fp8" and speed in ("compiled", "eager") and k:
        steps = _by_step(study, search, order[:k], table, speed == "compiled")
        if steps is not None:
            fast = steps.best()
            won = steps.time("chosen", fast)
            for r in order[:k]:
                if r.path not in fast:
                    reasons[r.path] = (f"kept in {study.high}: the {speed} training step is fastest with it in "
                                       f"{study.high} ({_step_text(steps, fast, won)})")
            keep = search.candidates(list(reasons))
            final = search.keeping(keep)
            run = study.run(final)
    if steps is None:
        run, final = search.run(k), search.policy(k)
        keep = search.kept(k)
    total = divergence(study.ref.losses, run.losses)
    table = replace(table, evaluations=study.evaluator.runs)
    kept = tuple(Kept(r, reasons[r.path]) for r in table.rows if r.path in reasons)
    lowered = tuple(r for r in table.rows if r.path not in reasons)
    notes = {x.layer.path: f"{x.layer.path}: {x.reason}; {_measured(x.layer, study.target, study.high)}"
             for x in kept}
    added = [(o, [notes[c.path] for c in layers]) for o, layers in
             keep_overrides(study.target, keep, MAX_ITEMS - len(study.policy.overrides))]
    header = _header(study, table, run, limits, len(kept))
    if steps is not None:
        device = study.device_kind()
        header += _steps_header(steps, speed, device)
        final = final.replace(tuned_on=device) if device else final
    text = render(final, study.policy, header, added, _tail(study, lowered))
    return Tuned(final, text, table, kept, lowered, run.mean, change(study.ref.losses, run.losses), total,
                 run.output_divergence, limit, limits.outputs)


def _by_step(study: Study, search: _Search, lowerable: Sequence[LayerSensitivity], table: Sensitivity,
             compiled: bool) -> SpeedSearch | None:
    """The step-time search over the layers the numerics allow in FP8 (None: the backend cannot time steps)."""
    hooks = study.evaluator.hooks
    if getattr(hooks, "step_seconds", None) is None:
        return None
    why = getattr(hooks, "no_fp8_speed", lambda model: None)(study.evaluator.model)
    if why:
        return None
    paths = [r.path for r in lowerable]
    high = [search.by_path[r.path] for r in table.rows if r.path not in set(paths)]
    named_hook = getattr(hooks, "fp8_candidate_sets", None)
    named = named_hook(study.evaluator.model, paths, study.recipe) if named_hook else {}

    def timer(fp8: frozenset[str]) -> float:
        return study.step_time(search.keeping([*high, *(search.by_path[p] for p in paths if p not in fp8)]), compiled)

    return SpeedSearch(paths, {r.path: r.shape for r in lowerable if r.shape}, timer, named)


def _step_text(steps: SpeedSearch, fast: frozenset[str], won: float) -> str:
    return (f"chosen set of {len(fast)} FP8 layers {won * 1e3:.3f} ms/step, no FP8 layer {steps.floor * 1e3:.3f} "
            f"ms/step; {len(steps.timed)} sets timed, noise {steps.noise:.1%}")


def _steps_header(steps: SpeedSearch, speed: str | None, device: str | None) -> list[str]:
    return [f"FP8 layers decided by the {speed} training step measured on {device or 'this device'} (forward + "
            f"backward of loss_fn on batches[0]; a difference counts above the noise {steps.noise:.1%}, from an A/A "
            f"pair); sets timed:",
            *(f"  {t.name}: {len(t.layers)} FP8 layers, {t.seconds * 1e3:.3f} ms/step" for t in steps.timed)]


def _header(study: Study, table: Sensitivity, run: Run, limits: Limits, kept: int) -> list[str]:
    s = table
    outputs = (f", output divergence {percent(run.output_divergence, False)}"
               if run.output_divergence is not None else "")
    source = "" if preset_of(study.policy) else f" ({study.policy.source})"
    limit = f", max_output_divergence {limits.outputs:.4g} per lowered layer" if outputs else ""
    return [
        f"Tuned by unimp.tune from policy {study.policy.name!r}{source} on backend {s.backend}: target "
        f"{s.lowered_to}, max_loss_increase {limits.loss:g}{limit}.",
        f"Measured on {s.batches} batch{'es' if s.batches > 1 else ''}: all {len(s.rows)} in {s.high}: loss "
        f"{s.reference_loss:.6g}; the policy as given: {s.lowered_loss:.6g} (divergence "
        f"{percent(s.lowered_divergence, False)}); this policy: {run.mean:.6g} (divergence "
        f"{percent(divergence(study.ref.losses, run.losses), False)}{outputs}).",
        f"{kept} of {len(s.rows)} layers kept in {s.high}, each with its numbers (that layer alone in {s.lowered_to}, "
        f"the other {len(s.rows) - 1} in {s.high}; divergence: mean |loss change| per batch / mean loss"
        + ("; output divergence: |outputs change| / |outputs|)." if outputs else ")."),
        *([f"FP8 speed-up: {s.speed_note}"] if s.target == "fp8" and s.speed_note else []),
    ]


def _tail(study: Study, lowered: Sequence[LayerSensitivity]) -> list[str]:
    if not lowered:
        return []
    return [f"Lowered to {lowered[0].lowered_to} by the policy ({len(lowered)} layers):",
            *(f"  {r.path}: {_measured(r, study.target, study.high)}" for r in lowered)]
