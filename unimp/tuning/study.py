"""A sensitivity study (``unimp.sensitivity``): the measured effect of lowering each layer alone.

The candidates are the layers the compiled Plan lowers and that ran (for FP8: the layers the report
shows running FP8 under the policy). The reference keeps all of them high (float32 for bf16/fp16, the
compute dtype for FP8; everything else runs as the policy says: :mod:`unimp.tuning.variants`); for each
candidate, the reference with that layer alone lowered runs ``loss_fn(amp.model, batch)`` over the
batches on a fresh copy of the model. A row holds the mean loss, its signed change and its divergence
(mean ``|change|`` per batch), both relative to the reference loss, and where the backend records the
model's outputs their divergence (``|outputs change| / |outputs|``), which shows values lost to the
format's range even where the loss of a model at initialisation does not move. Options: the FP8 GEMM
speed-up of each layer's shape (the backend's microbenchmark; "not measured" where the device has no
FP8 GEMMs) and a Hutchinson estimate of each layer's Hessian trace (HAWQ-v2; unimp-torch).

>>> percent(0.0125), percent(0.5, sign=False), speedup_text(None), speedup_text(1.3)
('+1.250%', '50.000%', 'not measured', '1.30x')
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from unimp.backend.registry import detect, get_backend
from unimp.dtypes import is_low, reference_tolerance
from unimp.errors import TuneError, UnimpWarning, UnsupportedError
from unimp.plan import Plan
from unimp.policy import Policy
from unimp.policy.loading import load
from unimp.policy.spec import MAX_NAME, show
from unimp.report import Report, RowTable, format_table
from unimp.tuning.evaluate import Evaluator, LossFn, Run, change, check_count, divergence, read_batches
from unimp.tuning.measurements import Shape
from unimp.tuning.variants import Candidate, high_of, lowering, reference, target_of

MAX_HESSIAN_SAMPLES = 1024
ROUNDINGS = 3  # roundings of one lowered GEMM layer: its two operands and its output


def rounding_bound(fmt: str, layers: int = 1) -> float:
    """The output divergence that rounding ``layers`` lowered layers to ``fmt`` explains (``u * sqrt(3 * layers)``,
    :func:`unimp.dtypes.reference_tolerance`); a layer above it lost values to the format's range.

    >>> rounding_bound("e4m3"), rounding_bound("bfloat16", 4)
    (0.10825317547305482, 0.013531646934131853)
    """
    return reference_tolerance(fmt, ROUNDINGS * layers)


@dataclass(frozen=True)
class LayerSensitivity:
    """One layer lowered alone: its loss, the change against the reference (signed, and the divergence: mean
    ``|change|`` per batch), both relative to the reference loss; optionally its FP8 GEMM shape and speed-up
    (high-precision time / FP8 time: > 1 is faster in FP8) and its Hessian trace estimate."""

    path: str
    kind: str | None
    lowered_to: str
    loss: float
    change: float
    divergence: float
    output_divergence: float | None = None
    shape: Shape | None = None
    speedup: float | None = None
    hessian_trace: float | None = None
    params: int | None = None


@dataclass(frozen=True)
class Sensitivity(RowTable):
    """The sensitivity table: one row per candidate layer, the most sensitive first.

    ``reference_loss``: every candidate layer at ``high`` (the precision the target is compared with), the rest as
    the policy runs it; ``format``: the number format a lowered layer rounds to (``e4m3`` for FP8);
    ``lowered_*``: the policy as given (every candidate lowered); ``noise``: the divergence of two reference
    runs (0 for a deterministic ``loss_fn``); ``speed_note``: why FP8 speed-ups were not measured, if not.
    """

    policy: str
    backend: str
    target: str
    recipe: str | None
    high: str
    format: str
    batches: int
    reference_loss: float
    lowered_loss: float
    lowered_divergence: float
    lowered_output_divergence: float | None
    noise: float
    rows: tuple[LayerSensitivity, ...]
    evaluations: int
    speed_note: str = ""

    @property
    def rounding(self) -> float:
        """The output divergence rounding one layer to :attr:`format` explains (:func:`rounding_bound`)."""
        return rounding_bound(self.format)

    @property
    def lowered_to(self) -> str:
        """``fp8 (tensorwise)``, ``bfloat16`` or ``float16``."""
        return f"fp8 ({self.recipe})" if self.target == "fp8" else self.target

    def __str__(self) -> str:
        speed = self.target == "fp8"
        hessian = any(r.hessian_trace is not None for r in self.rows)
        outs = any(r.output_divergence is not None for r in self.rows)
        head = ("layer", "kind", "loss", "change", "divergence", *(("output div.",) if outs else ()),
                *(("fp8 speed-up", "M x K x N") if speed else ()),
                *(("hessian trace", "per param") if hessian else ()))
        rows = [(r.path, r.kind or "-", f"{r.loss:.6g}", percent(r.change), percent(r.divergence, sign=False),
                 *((percent(r.output_divergence, False) if r.output_divergence is not None else "-",) if outs else ()),
                 *((speedup_text(r.speedup), "x".join(map(str, r.shape)) if r.shape else "-") if speed else ()),
                 *((f"{r.hessian_trace:.4g}", f"{r.hessian_trace / max(r.params or 1, 1):.4g}")
                   if hessian and r.hessian_trace is not None else (("-", "-") if hessian else ())))
                for r in self.rows]
        title = (f"unimp sensitivity: policy {self.policy!r} on {self.backend}: each layer alone in {self.lowered_to}, "
                 f"the other layers below in {self.high}; {self.batches} batch{'es' if self.batches > 1 else ''}, "
                 f"most sensitive first\nreference (all of them in {self.high}) loss {self.reference_loss:.6g}; all "
                 f"lowered (the policy as given) {self.lowered_loss:.6g} (divergence "
                 f"{percent(self.lowered_divergence, False)}"
                 + (f", output divergence {percent(self.lowered_output_divergence, False)}"
                    if self.lowered_output_divergence is not None else "") + ")")
        footer = ([f"output div.: above {percent(self.rounding, False)} (what rounding one layer to {self.format} "
                   f"explains: u*sqrt(3)) the layer lost values to the format's range"] if outs else []) + (
            [f"fp8 speed-up: {self.speed_note}"] if speed and self.speed_note else []) + (
            [f"noise: two reference runs differ by {percent(self.noise, False)} (loss_fn is not deterministic: "
             f"put the model in eval mode; changes below this are noise)"] if self.noise else [])
        return format_table(head, rows, title=title, footer=footer)


def percent(x: float, sign: bool = True) -> str:
    """``x`` as a percentage (``+1.25%``, ``inf``)."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:+.3%}" if sign else f"{x:.3%}"


def speedup_text(s: float | None) -> str:
    return "not measured" if s is None else f"{s:.2f}x"


class Study:
    """What sensitivity and tuning share: the policy, its Plan and target, the reference and the policy's own
    runs, the candidate layers and the evaluator (each run is counted)."""

    def __init__(self, policy: Any, model: Any, batches: Any, loss_fn: LossFn, *, target: Any = None,
                 layers: Any = None, max_layers: int = 64, max_batches: int = 8, backend: str | None = None) -> None:
        check_count("max_layers", max_layers)
        globs = _globs(layers)
        self.policy = load(policy)
        self.backend = get_backend(backend) if backend else detect(model)
        self.plan: Plan = self.backend.compile(self.policy, model)
        self.target = target_of(self.policy, self.plan.compute_dtype, target)
        self.high = high_of(self.target, self.plan.compute_dtype)
        self.evaluator = Evaluator(model, read_batches(batches, max_batches), loss_fn, self.backend)
        self.lowered = self.evaluator.run(self.policy, report=True, keep=True)
        self.candidates = _candidates(self.plan, self.lowered.report, self.target, globs, max_layers)
        self.reference = reference(self.policy, self.target, self.candidates)
        self.ref = self.evaluator.run(self.reference, keep=True)
        bad = [i for i, x in enumerate(self.ref.losses) if not math.isfinite(x)]
        if bad or not any(self.ref.losses):
            why = f"is {self.ref.losses[bad[0]]} on batches[{bad[0]}]" if bad else "is 0 on every batch"
            raise TuneError(f"loss_fn {why} under the reference policy (the layers it lowers in {self.high}): "
                            f"changes relative to it are undefined; check the model and batches first")
        self.evaluator.baseline = self.ref.outputs
        self.lowered_output_divergence = self.evaluator.compare(self.lowered.outputs)
        self.lowered = replace(self.lowered, outputs=None)  # compared: no need to hold them
        self.noise = divergence(self.ref.losses, self.evaluator.run(self.reference).losses)
        if self.noise:
            warnings.warn(f"unimp.sensitivity: two runs of loss_fn under the same policy differ by "
                          f"{percent(self.noise, False)} of the loss (dropout, batch statistics, randomness): put "
                          f"the model in eval mode in loss_fn; sensitivities below this are noise", UnimpWarning,
                          stacklevel=3)

    @property
    def recipe(self) -> str | None:
        return self.plan.fp8.recipe if self.target == "fp8" and self.plan.fp8 is not None else None

    @property
    def format(self) -> str:
        """The number format a lowered layer rounds to: the FP8 forward format, or the target dtype."""
        return self.plan.fp8.forward_format if self.target == "fp8" and self.plan.fp8 is not None else self.target

    def run(self, policy: Any) -> Run:
        return self.evaluator.run(policy)

    def measure(self, speed: Any = True, hessian_samples: int = 0, seed: int = 0) -> Sensitivity:
        """One run per candidate (plus the options), the table sorted by divergence. ``speed="gemm"``: each layer's
        FP8 GEMM speed-up; ``"compiled"``/``"eager"``: the GEMM shapes only (whole steps decide: :meth:`step_time`)."""
        lowered_to = f"fp8 {self.recipe}" if self.target == "fp8" else self.target
        paths = [c.path for c in self.candidates]
        mode = speed_mode(speed) if self.target == "fp8" else None
        shapes, speedups, note = self._speed(paths, mode == "gemm") if mode else ({}, {}, "")
        traces = self._hessian(paths, hessian_samples, seed) if hessian_samples else {}
        rows = []
        for c in self.candidates:
            trace = traces.get(c.path)
            run = self.run(lowering(self.policy, self.target, self.candidates, c))
            rows.append(LayerSensitivity(c.path, c.kind, lowered_to, run.mean, change(self.ref.losses, run.losses),
                                         divergence(self.ref.losses, run.losses),
                                         run.output_divergence, shapes.get(c.path), speedups.get(c.path),
                                         trace[0] if trace else None, trace[1] if trace else None))
        rows.sort(key=lambda r: (-r.divergence, r.path))
        return Sensitivity(self.policy.name, self.backend.name, self.target, self.recipe, self.high, self.format,
                           len(self.ref.losses), self.ref.mean, self.lowered.mean,
                           divergence(self.ref.losses, self.lowered.losses), self.lowered_output_divergence,
                           self.noise, tuple(rows), self.evaluator.runs, note)

    def _speed(self, paths: Sequence[str], gemm: bool) -> tuple[dict[str, Shape], dict[str, float], str]:
        """Each layer's GEMM shape and (``gemm``) FP8 GEMM speed-up, or why they are not measured."""
        hooks = self.evaluator.hooks
        shaper, timer = getattr(hooks, "gemm_shapes", None), getattr(hooks, "fp8_gemm_times", None)
        if shaper is None or (gemm and timer is None):
            return {}, {}, f"not measured (backend {self.backend.name} has no FP8 GEMM microbenchmark)"
        model, ev = self.evaluator.copy(), self.evaluator
        with ev.evaluating():
            shapes = shaper(model, paths, lambda: ev.loss_fn(model, ev.batches[0]))
        if not gemm:
            why = getattr(hooks, "no_fp8_speed", None)
            return shapes, {}, (why(model) if why else None) or ""
        fp8 = self.plan.fp8
        assert fp8 is not None and timer is not None
        times = timer(model, sorted(set(shapes.values())), fp8.recipe, self.plan.compute_dtype, fp8.gradient_format)
        if isinstance(times, str):
            return shapes, {}, times
        return shapes, {p: times[s][0] / times[s][1] for p, s in shapes.items() if s in times}, ""

    def step_time(self, policy: Policy, compiled: bool) -> float:
        """Seconds of one training step (forward and backward of ``loss_fn`` on the first batch) under ``policy``,
        compiled or eager, as the backend measures it on the model's device."""
        ev = self.evaluator
        return float(ev.hooks.step_seconds(ev.model, policy, ev.loss_fn, ev.batches[0], compiled))

    def device_kind(self) -> str | None:
        """The kind of device the model is on (speed decisions hold there), where the backend says."""
        hook = getattr(self.evaluator.hooks, "device_kind", None)
        return None if hook is None else str(hook(self.evaluator.model))

    def _hessian(self, paths: Sequence[str], samples: int, seed: int) -> dict[str, tuple[float, int]]:
        hook = getattr(self.evaluator.hooks, "hessian_traces", None)
        if hook is None:
            raise UnsupportedError(f"hessian_samples={samples}: backend {self.backend.name} has no gradient hook "
                                   f"for the Hutchinson estimate (unimp-torch has one); pass hessian_samples=0")
        ev = self.evaluator
        traces: dict[str, tuple[float, int]] = hook(ev.copy(), ev.loss_fn, ev.batches, paths, samples, seed)
        return traces


SPEED_MODES = ("compiled", "eager", "gemm")


def speed_mode(speed: Any) -> str | None:
    """``speed`` as a mode: ``"compiled"`` (True: whole training steps, compiled), ``"eager"``, ``"gemm"`` (the
    FP8 GEMM microbenchmark per layer shape) or None (False: speed not measured).

    >>> speed_mode(True), speed_mode("gemm"), speed_mode(False)
    ('compiled', 'gemm', None)
    """
    if isinstance(speed, bool):
        return "compiled" if speed else None
    if speed not in SPEED_MODES:
        raise TuneError(f"speed={show(speed)}: expected True (= \"compiled\"), \"compiled\" (whole training "
                        f"steps, torch.compile'd: what decides FP8 speed when the user compiles), \"eager\", "
                        f"\"gemm\" (the per-shape FP8 GEMM microbenchmark) or False")
    return str(speed)


def check_options(speed: Any, hessian_samples: Any, seed: Any) -> None:
    """The measurement options, checked before any run."""
    speed_mode(speed)
    check_count("hessian_samples", hessian_samples, 0, MAX_HESSIAN_SAMPLES)
    check_count("seed", seed, 0)


def _globs(layers: Any) -> tuple[str, ...] | None:
    if layers is None:
        return None
    if isinstance(layers, str):
        layers = [layers]
    if not isinstance(layers, list | tuple) or not layers or not all(
            isinstance(g, str) and g.strip() and len(g) <= MAX_NAME for g in layers):
        raise TuneError(f"layers={show(layers)}: expected a non-empty list of module-path globs (e.g. "
                        f"['blocks.*.mlp.*']) of at most {MAX_NAME} characters, or None for every layer")
    return tuple(layers)


def _candidates(plan: Plan, report: Report | None, target: str, globs: tuple[str, ...] | None,
                max_layers: int) -> tuple[Candidate, ...]:
    """The layers the policy lowers that ran (FP8: the report's FP8 rows; a dtype: the Plan's lowered layers)."""
    rows = report.rows if report is not None else []
    ran = {r.path for r in rows}
    if target == "fp8":
        found = [Candidate(r.path, r.kind, plan.compute_dtype, recipe=r.fp8) for r in rows
                 if r.fp8 and r.path not in ("", "<model>")]
    else:
        found = [Candidate(r.path, r.kind, r.decision.compute_dtype, r.decision.param_dtype) for r in plan.layers
                 if r.path and r.path in ran and is_low(r.decision.compute_dtype)]
    if globs is not None:
        for i, g in enumerate(globs):
            if not any(fnmatch.fnmatchcase(c.path, g) for c in found):
                some = ", ".join(c.path for c in found[:8]) + (", ..." if len(found) > 8 else "")
                raise TuneError(f"layers[{i}]: {g!r} matches no layer the policy lowers on this model "
                                f"(those are: {some or 'none'})")
        found = [c for c in found if any(fnmatch.fnmatchcase(c.path, g) for g in globs)]
    if not found:
        raise TuneError(f"the policy lowers no layer of this model to {target} (its Plan and report show none); "
                        f"nothing to measure: check the policy's ops lists{' and fp8.ops' if target == 'fp8' else ''}")
    if len(found) > max_layers:
        raise TuneError(f"the policy lowers {len(found)} layers of this model, more than max_layers={max_layers}; "
                        f"each costs one run over the batches: raise max_layers, or choose layers with "
                        f"layers=['glob', ...] (first ones: {', '.join(c.path for c in found[:5])})")
    return tuple(found)
