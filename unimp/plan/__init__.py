"""A policy compiled for one backend: the whole contract between the core and a backend.

A backend receives a :class:`PlanRequest` (:mod:`unimp.plan.request`: the policy as asked, its
overrides resolved by the core) and builds the Plan with ``request.compile(...)`` (:func:`compile_ops`)
from what it can control (control level and native names per canonical op) and, when a model is
given, its index (:class:`LayerInfo` per layer: path, kind, class names, tiling dims). The Plan then
carries, as typed, resolved fields, every decision a backend acts on: the compute dtype and why, the
per-op table, the per-layer decision table (overrides resolved once, ambiguous matches reported), the
loss-scale spec that runs, the settings, FP8 and the layout findings with their action. Backends
read the Plan, never the policy; it prints as the table ``unimp explain`` shows.

The classes live in named modules, which this package re-exports: :mod:`unimp.plan.contract` (the
request and the Plan, with the example), :mod:`unimp.plan.tables` (their rows), :mod:`unimp.plan.request`,
:mod:`unimp.plan.fp8` and :mod:`unimp.plan.layout`.
"""

from __future__ import annotations

from unimp.plan.contract import Plan, PlanRequest, compile_ops, describe_loss_scale
from unimp.plan.request import DtypeRequest, requested_dtype
from unimp.plan.tables import CONTROL_LEVELS, LayerInfo, LayerRow, OpDecision, compile_layers, compile_layout

__all__ = ["CONTROL_LEVELS", "DtypeRequest", "LayerInfo", "LayerRow", "OpDecision", "Plan", "PlanRequest",
           "compile_layers", "compile_layout", "compile_ops", "describe_loss_scale", "requested_dtype"]
