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
- the shared algorithms and facts: the loss-scale rule, dtype helpers, the CPU facts and the
  ``auto`` resolvers;
- the output: :class:`Report`, :class:`ReportRow`; errors and :class:`UnimpWarning`;
- the conformance kit base: :class:`Kit`, :class:`Observation` and the probe's constants.
"""

from __future__ import annotations

from .backend import TAGS, Amp, Backend, NoForwardError
from .conformance.kit import Kit, Observation
from .conformance.probe import CHANNELS, CLASSES, HIDDEN, KERNEL, LN_EPS, PROBE, TIME, VOCAB, ProbeBatch
from .dtypes import dtype_name, is_low, widest
from .errors import PolicyError, StateError, UnimpWarning, UnsupportedError
from .hardware import CpuFacts, cpu, resolve_auto, resolve_cpu_auto, warn_emulated
from .layout import LayoutFindings
from .loading import load
from .loss_scale import LossScale, LossScaleAtMinimumError, LossScaleState, f32
from .migrate.paddle import PADDLE_NATIVE_OPS
from .ops import CANONICAL_OPS, OPS, class_names, kind_of, kind_of_names, native_table
from .plan import LayerInfo, Plan, compile_ops, requested_dtype, resolved_loss_scale
from .policy import LayerDecision, Layout, LossScaleSpec, Policy
from .registry import apply, is_applied, remember
from .report import Report, ReportRow

__all__ = [
    # the plug-in
    "TAGS", "Amp", "Backend", "NoForwardError", "is_applied", "remember",
    # the input
    "LayerDecision", "Layout", "LossScaleSpec", "Policy", "apply", "load",
    # the compiled contract and the op vocabulary
    "CANONICAL_OPS", "OPS", "LayerInfo", "LayoutFindings", "Plan", "class_names", "compile_ops", "kind_of",
    "kind_of_names", "native_table", "requested_dtype", "resolved_loss_scale", "PADDLE_NATIVE_OPS",
    # shared algorithms and facts
    "CpuFacts", "LossScale", "LossScaleAtMinimumError", "LossScaleState", "cpu", "dtype_name", "f32", "is_low",
    "resolve_auto", "resolve_cpu_auto", "warn_emulated", "widest",
    # the output, errors, warnings
    "PolicyError", "Report", "ReportRow", "StateError", "UnimpWarning", "UnsupportedError",
    # the conformance kit base and the probe
    "CHANNELS", "CLASSES", "HIDDEN", "KERNEL", "LN_EPS", "PROBE", "TIME", "VOCAB", "Kit", "Observation",
    "ProbeBatch",
]
