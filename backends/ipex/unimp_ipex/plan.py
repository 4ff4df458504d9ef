"""The request compiled for an Intel CPU: unimp-torch's CPU plan plus the engine, hardware and IPEX mode.

The op table, autocast dtype and op moves are unimp-torch's (:class:`IpexDetails` extends its
``TorchDetails``, so its ``bind`` runs the plan); this module adds which engine runs it and why,
what the CPU can do, and how ``ipex.optimize`` is called.

>>> import unimp
>>> from unimp.spi import Plan, hardware
>>> from unimp_ipex.engine import Engine
>>> plan = compile_plan(Plan.request(unimp.load({"compute_dtype": "auto"}), "ipex"), None, Engine("torch", "demo"),
...                     hardware.CpuFacts("x86_64", "demo", frozenset(hardware.LEVELS["avx2"])))
>>> plan.compute_dtype, plan.details.cpu["native_bf16"]
('float32', False)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unimp.spi import Plan, PlanRequest, dtypes, hardware
from unimp_torch.extension import TorchDetails, model_index
from unimp_torch.extension import compile_plan as torch_plan

from .engine import Engine
from .hardware import check, resolve_auto
from .modes import IpexSettings, choose

FP8_MISSING = ("unimp-ipex drives ipex.optimize on CPU, which trains in bfloat16/float16 only (IPEX's FP8, "
               "fp8_autocast, is for Intel GPUs); for FP8 training use the torch backend (torchao) on an "
               "FP8 GPU")


def resolve_compute(request: PlanRequest, cpu: hardware.CpuFacts) -> tuple[str, str]:
    """``compute_dtype`` on this CPU (``auto`` resolved, with the reason); warns or refuses slow dtypes."""
    if request.compute_dtype == "auto":
        return resolve_auto(cpu)
    emulated = check(cpu, request.compute_dtype, "compute_dtype")
    for setting, dtype in request.compute_requests()[1:]:  # the overrides'
        if dtypes.is_low(dtype):
            check(cpu, dtype, setting)
    if emulated:
        return request.compute_dtype, f"as the policy says (emulated on this CPU, slower than float32: " \
                                      f"{cpu.describe()})"
    return request.compute_dtype, "as the policy says"


@dataclass(frozen=True)
class IpexDetails(TorchDetails):
    """unimp-torch's details plus the engine, the CPU facts and the IPEX settings (None: engine torch)."""

    engine: str = "torch"
    engine_reason: str = ""
    cpu: Mapping[str, object] = field(default_factory=dict)
    ipex: IpexSettings | None = None


def compile_plan(request: PlanRequest, model: Any, engine: Engine, cpu: hardware.CpuFacts) -> Plan:
    """The Plan of backend ``ipex`` for ``request`` (``model`` decides IPEX's mode when given): torch's
    plan of the request at the compute dtype resolved on ``cpu``, run by ``engine``."""
    compute, reason = resolve_compute(request, cpu)
    with warnings.catch_warnings():  # the emulation warning came from `check` above, on these facts
        warnings.filterwarnings("ignore", message="unimp: .* emulates ")
        base = torch_plan(request.at(compute), model, "cpu", fp8_missing=FP8_MISSING)
    base = dataclasses.replace(base, compute_reason=reason, notes=(f"cpu: {cpu.describe()}", *base.notes),
                               details=IpexDetails(**vars(base.details), cpu=cpu.record()))
    return on_engine(base, model, engine, cpu)


def on_engine(plan: Plan, model: Any, engine: Engine, cpu: hardware.CpuFacts) -> Plan:
    """``plan`` bound to ``model`` (None: not known yet) and run by ``engine``: the model's layers, the
    engine and IPEX's mode (binding a Plan compiled without the model, or for the other engine, redoes this)."""
    d = plan.details
    notes = plan.notes[bool(d.engine_reason) + (d.ipex is not None):]  # without a previous engine's lines
    if model is not None and not plan.layers:
        plan = plan.with_index(model_index(model))
    head, settings = [f"engine: {engine.name} ({engine.reason})"], None
    if engine.name == "ipex":
        settings = choose(plan, model, cpu, engine.ipex_version)
        head.append(f"ipex.optimize(dtype={settings.dtype}, weights_prepack={settings.weights_prepack}): "
                    f"{settings.reason}")
    details = dataclasses.replace(d, engine=engine.name, engine_reason=engine.reason, ipex=settings)
    return dataclasses.replace(plan, notes=(*head, *notes), details=details)
