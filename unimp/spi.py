"""The backend interface: everything a backend package may import from the unimp core.

A backend (``unimp_torch``, ``unimp_jax``, ... or a new one) imports core names from this module
only, never from ``unimp.plan``, ``unimp.policy`` & co. directly: the core may then move code
between its modules without breaking any backend, and this file is the whole list of what a
backend builds on (``tests/test_backend_imports.py`` enforces it). Users import ``unimp``.

>>> from unimp.spi import Backend, Plan, Policy, UnsupportedError
>>> Backend.priority, Plan.__name__, Policy.__name__, issubclass(UnsupportedError, Exception)
(0, 'Plan', 'Policy', True)

What is here, by job:

- the plug-in: :class:`Backend` (subclass it; entry point ``unimp.backends``; declare ``native_ops`` and
  ``tags`` from ``TAGS``), :class:`Amp` (the handle ``apply`` returns; ``NoForwardError``), ``remember`` /
  ``is_applied`` (the registry of applied models);
- the input: :class:`Policy` and its parts, ``load``, ``apply`` (for kits and integrations);
- the compiled contract: :class:`Plan`, ``compile_ops`` (with a model index of :class:`LayerInfo`),
  ``requested_dtype``, :class:`LayoutFindings`, the op vocabulary and the class -> op walk;
- FP8: :class:`Fp8Support` (what a backend declares it can run), :class:`Fp8Plan` (``plan.fp8``),
  ``decide_fp8`` (FP8 or not per layer, with the recipe and the reason), ``fp8_report_notes``;
- the shared algorithms and facts: the loss-scale rule, dtype helpers, the CPU facts and the
  ``auto`` resolvers;
- the output: :class:`Report`, :class:`ReportRow`; errors and :class:`UnimpWarning`;
- the conformance kit base: :class:`Kit`, :class:`Observation` and the probe's constants.
"""

from __future__ import annotations

from unimp.backend import TAGS, Amp, Backend, NoForwardError
from unimp.backend.applied import is_applied
from unimp.backend.registry import apply, remember
from unimp.backend.transaction import Snapshot
from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import CHANNELS, CLASSES, HIDDEN, KERNEL, LN_EPS, PROBE, TIME, VOCAB, ProbeBatch
from unimp.dtypes import dtype_name, is_low, widest
from unimp.errors import PolicyError, StateError, UnimpWarning, UnsupportedError
from unimp.hardware import CpuFacts, cpu, resolve_auto, resolve_cpu_auto, warn_emulated
from unimp.loss_scale import LossScale, LossScaleAtMinimumError, LossScaleState, f32, policy_problems
from unimp.loss_scale.rule import ArrayOps, Arrays, held, step, tiny
from unimp.migrate.paddle import PADDLE_NATIVE_OPS
from unimp.plan import (
    LayerInfo,
    Plan,
    compile_ops,
    loss_scale_as_run,
    loss_scale_fallbacks,
    requested_dtype,
    resolved_loss_scale,
)
from unimp.plan.fp8 import (
    FP8_FORMATS,
    Fp8Decision,
    Fp8Plan,
    Fp8Support,
    asks_fp8,
    decide_fp8,
    fp8_report_notes,
    plan_fp8,
    requests_fp8,
)
from unimp.plan.layout import LayoutFindings
from unimp.policy import LayerDecision, Layout, LossScaleSpec, Policy
from unimp.policy.loading import load
from unimp.policy.ops import CANONICAL_OPS, OPS, class_names, kind_of, kind_of_names, native_table
from unimp.policy.spec import FLT_TINY, INT32_MAX
from unimp.report import Report, ReportRow

__all__ = [
    # the plug-in
    "TAGS", "Amp", "Backend", "NoForwardError", "Snapshot", "is_applied", "remember",
    # the input
    "LayerDecision", "Layout", "LossScaleSpec", "Policy", "apply", "load",
    # the compiled contract and the op vocabulary
    "CANONICAL_OPS", "OPS", "LayerInfo", "LayoutFindings", "Plan", "class_names", "compile_ops", "kind_of",
    "kind_of_names", "native_table", "requested_dtype", "resolved_loss_scale", "PADDLE_NATIVE_OPS",
    # what a backend cannot honour of the loss-scale knobs
    "loss_scale_as_run", "loss_scale_fallbacks",
    # FP8: what a backend can run, the Plan's part, the per-layer decision
    "FP8_FORMATS", "Fp8Decision", "Fp8Plan", "Fp8Support", "asks_fp8", "decide_fp8", "fp8_report_notes", "plan_fp8",
    "requests_fp8",
    # shared algorithms and facts
    "CpuFacts", "LossScale", "LossScaleAtMinimumError", "LossScaleState", "cpu", "dtype_name", "f32", "is_low",
    "resolve_auto", "resolve_cpu_auto", "warn_emulated", "widest",
    # the loss-scale rule, written once over an array adapter (unimp.loss_scale.rule)
    "ArrayOps", "Arrays", "FLT_TINY", "INT32_MAX", "held", "policy_problems", "step", "tiny",
    # the output, errors, warnings
    "PolicyError", "Report", "ReportRow", "StateError", "UnimpWarning", "UnsupportedError",
    # the conformance kit base and the probe
    "CHANNELS", "CLASSES", "HIDDEN", "KERNEL", "LN_EPS", "PROBE", "TIME", "VOCAB", "Kit", "Observation",
    "ProbeBatch",
]
