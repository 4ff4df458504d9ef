"""The plug-in surface: every core name a backend package may import (28 names).

A backend (``unimp_torch``, ``unimp_jax``, ... or a new one) imports the core from this module only
(its conformance kit also from :mod:`unimp.conformance.kit`), never from ``unimp.plan``,
``unimp.policy`` & co.: the core may then move code between its modules without breaking any backend,
and this file is the whole list of what a backend builds on (``tests/test_backend_imports.py`` enforces
it, doctests and ``importlib`` strings included). A backend reads the :class:`Plan`, never a Policy:
``Policy`` is not here, and ``tests/test_backend_shape.py`` fails on any ``.policy`` read in a backend.

>>> from unimp.spi import Backend, Plan, UnsupportedError
>>> Backend.priority, Plan.__name__, issubclass(UnsupportedError, Exception)
(0, 'Plan', True)

By job:

- the plug-in: :class:`Backend` (subclass it, implement ``accepts`` / ``plan`` / ``apply``; entry point
  ``unimp.backends``), :class:`Amp` (the handle ``apply`` returns), :class:`Snapshot` (what ``apply``
  may change, restored when it fails);
- the compiled contract: :class:`Plan` (``Backend.plan`` receives the request ``Plan.request(policy,
  backend)``, a :class:`PlanRequest`: the overrides resolved by the core, and returns
  ``request.compile(...)``), :class:`LayerInfo` (one layer of the model index), :class:`LossScaleSpec`,
  :class:`Fp8Support` (what a backend can run in FP8) and :class:`Fp8Decision` (one layer's FP8 verdict);
- the loss-scale rule, written once: :class:`LossScale` (on Python numbers), :func:`step` over the
  array-ops protocol :class:`ArrayOps` with its state :class:`Arrays` (on device), :class:`LossScaleState`;
- the output: :class:`Report`, :class:`ReportRow`; errors: :class:`UnsupportedError`,
  :class:`StateError`, :class:`LossScaleAtMinimumError`, :class:`UnimpWarning`;
- for kits and integrations, as users call them: :func:`load`, :func:`apply`;
- three vocabularies, each a module: ``ops`` (the canonical ops, ``native_table``, the class -> op walk
  ``kind_of``), ``dtypes`` (dtype names, float32/int32 facts, ``f32``) and ``hardware`` (the CPU facts,
  the ``auto`` resolvers, ``warn_emulated``);
- ``strays``: when an optimizer unimp does not wrap steps an applied model wrongly, and its refusal;
- ``files``: the one writer of every file unimp writes (``write_file``: whole or not at all).
"""

from __future__ import annotations

from unimp import dtypes, files, hardware
from unimp.backend import Amp, Backend
from unimp.backend.registry import apply
from unimp.backend.transaction import Snapshot
from unimp.errors import StateError, UnimpWarning, UnsupportedError
from unimp.loss_scale import LossScale, LossScaleAtMinimumError, LossScaleState, strays
from unimp.loss_scale.iteration import Iteration
from unimp.loss_scale.rule import ArrayOps, Arrays, step
from unimp.plan import LayerInfo, Plan, PlanRequest
from unimp.plan.fp8 import Fp8Decision, Fp8Support
from unimp.policy import LossScaleSpec, ops
from unimp.policy.loading import load
from unimp.report import Report, ReportRow

__all__ = [
    # the plug-in
    "Amp", "Backend", "Snapshot",
    # the compiled contract
    "Fp8Decision", "Fp8Support", "LayerInfo", "LossScaleSpec", "Plan", "PlanRequest",
    # the loss-scale rule and its array-ops protocol; one update per iteration over several optimizers
    "ArrayOps", "Arrays", "Iteration", "LossScale", "LossScaleState", "step",
    # the output, errors, warnings
    "LossScaleAtMinimumError", "Report", "ReportRow", "StateError", "UnimpWarning", "UnsupportedError",
    # for kits and integrations
    "apply", "load",
    # vocabularies (modules), the file writer; optimizers stepping an applied model around unimp (module)
    "dtypes", "files", "hardware", "ops", "strays",
]
