"""A policy compiled for an Intel CPU: unimp-torch's CPU plan plus the engine, hardware and IPEX mode.

The op table, autocast dtype and op moves are unimp-torch's (:class:`IpexDetails` extends its
``TorchDetails``, so its ``bind`` runs the plan); this module adds which engine runs it and why,
what the CPU can do, and how ``ipex.optimize`` is called.

>>> import unimp
>>> from unimp_ipex.engine import Engine
>>> from unimp.hardware import LEVELS, CpuFacts
>>> plan = compile_plan(unimp.load({"compute_dtype": "auto"}), None, Engine("torch", "demo"),
...                     CpuFacts("x86_64", "demo", frozenset(LEVELS["avx2"])))
>>> plan.compute_dtype, plan.details.cpu["native_bf16"]
('float32', False)
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unimp.spi import CpuFacts, Fp8Support, Plan, Policy, is_low, plan_fp8
from unimp_torch.extension import TorchDetails, model_index
from unimp_torch.extension import compile_plan as torch_plan

from .engine import Engine
from .hardware import check, resolve_auto

FP8_MISSING = ("unimp-ipex drives ipex.optimize on CPU, which trains in bfloat16/float16 only (IPEX's FP8, "
               "fp8_autocast, is for Intel GPUs); for FP8 training use the torch backend (torchao) on an "
               "FP8 GPU")


def resolve_compute(policy: Policy, cpu: CpuFacts) -> tuple[str, str]:
    """``compute_dtype`` on this CPU (``auto`` resolved, with the reason); warns or refuses slow dtypes."""
    if policy.compute_dtype == "auto":
        return resolve_auto(cpu)
    emulated = check(cpu, policy.compute_dtype, "compute_dtype")
    for i, o in enumerate(policy.overrides):
        if is_low(o.compute_dtype):
            check(cpu, o.compute_dtype, f"overrides[{i}].compute_dtype")
    if emulated:
        return policy.compute_dtype, f"as the policy says (emulated on this CPU, slower than float32: {cpu.describe()})"
    return policy.compute_dtype, "as the policy says"


@dataclass(frozen=True)
class IpexSettings:
    """How ``ipex.optimize`` is called."""

    version: str | None
    dtype: str
    weights_prepack: bool
    reason: str


@dataclass(frozen=True)
class IpexDetails(TorchDetails):
    """unimp-torch's details plus the engine, the CPU facts and the IPEX settings (None: engine torch)."""

    engine: str = "torch"
    engine_reason: str = ""
    cpu: Mapping[str, object] = field(default_factory=dict)
    ipex: IpexSettings | None = None


def compile_plan(policy: Policy, model: Any, engine: Engine, cpu: CpuFacts) -> Plan:
    """The Plan of backend ``ipex`` for ``policy`` (``model`` decides IPEX's mode when given)."""
    compute, reason = resolve_compute(policy, cpu)
    fp8 = plan_fp8(policy, "ipex", Fp8Support(missing=FP8_MISSING))  # refused here, or the reported fallback
    resolved = policy if policy.compute_dtype == compute else policy.replace(compute_dtype=compute)
    with warnings.catch_warnings():  # the emulation warning came from `check` above, on these facts
        warnings.filterwarnings("ignore", message="unimp: .* emulates ")
        base = torch_plan(resolved, "cpu", model_index(model) if model is not None else None, fp8_missing=FP8_MISSING)
    notes = [f"engine: {engine.name} ({engine.reason})", f"cpu: {cpu.describe()}", *base.notes]
    settings = None
    if engine.name == "ipex":
        from .modes import choose

        # the torch Plan with this policy: its loss scale resolved from the policy's own compute_dtype
        mode = choose(dataclasses.replace(base, policy=policy, compute_dtype=compute), model, cpu)
        settings = IpexSettings(engine.ipex_version, mode.dtype, mode.weights_prepack, mode.reason)
        notes.insert(1, f"ipex.optimize(dtype={mode.dtype}, weights_prepack={mode.weights_prepack}): {mode.reason}")
    return dataclasses.replace(base, backend="ipex", policy=policy, compute_dtype=compute,
                               compute_reason=reason, notes=tuple(notes), fp8=fp8,
                               details=IpexDetails(**vars(base.details), engine=engine.name,
                                                   engine_reason=engine.reason, cpu=cpu.record(), ipex=settings))
