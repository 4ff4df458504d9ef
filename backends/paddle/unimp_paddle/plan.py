"""The request -> the Plan for Paddle's dygraph AMP or the legacy static bf16 rewrite.

What Paddle can run decides the Plan, never the wish list: on CPU, dygraph ``auto_cast`` and
``decorate`` do nothing (Paddle 3.x has no CPU low-precision dygraph kernels), so every op the
policy wants in low precision is reported as running in float32 (``on_unsupported`` decides:
error or reported fallback). The static path runs bf16 on CPU for the ops measured to work, where
Paddle's oneDNN has bf16 kernels (``unimp.hardware``: AVX512 BW/VL/DQ or AVX-NE-CONVERT); on other
CPUs it runs float32 the same way.

>>> import unimp
>>> from unimp.spi import Plan
>>> plan = compile_plan(Plan.request(unimp.load({"extends": "mixed_bf16", "on_unsupported": "fallback"}), "paddle"))
>>> plan.op("matmul").dtype, plan.op("matmul").honoured
('float32', False)
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from unimp.spi import Fp8Support, LayerInfo, Plan, PlanRequest, dtypes, hardware

from .index import model_index
from .ops import OpLists, compile_lists, layer_types, op_types

FIX = ("change the policy (e.g. compute_dtype/param_dtype = \"float32\" on CPU, or use a CUDA place)")
FP8_MISSING = ("unimp-paddle has no FP8 training path: paddle.amp (auto_cast/decorate) runs float16/bfloat16 "
               "only, and Paddle's FP8 GEMMs are incubate GPU kernels with no layer-level training API; "
               "for FP8 training use the torch backend (torchao) on an FP8 GPU")
CPU_WHY = ("Paddle 3.x dygraph has no CPU float16/bfloat16 kernels: auto_cast/decorate are no-ops on "
           "CPUPlace, so Paddle runs it in float32")
# Measured on this CPU (paddlepaddle 3.3.1, FLAGS_use_mkldnn=0, legacy IR): ops whose bf16 kernel fails.
STATIC_BF16_BROKEN = {
    "elementwise": "elementwise_add in bf16 fails on CPU ('type of data (bfloat16) does not match "
                   "float32'); the static rewrite keeps elementwise ops in float32",
    "layer_norm": "bf16 layer_norm on CPU mis-reads inputs of rank > 2; kept float32",
}


@dataclass(frozen=True)
class PaddleDetails:
    """What the paddle backend decided at compile time (``plan.details``)."""

    mode: str  # dygraph | static
    place: str  # cpu | gpu
    amp_active: bool  # whether Paddle's AMP runs at all (else everything runs float32)
    amp_dtype: str
    param_dtype: str
    level: str | None = None  # dygraph: O1 | O2
    lists: OpLists = field(default_factory=OpLists)  # Paddle's op-type lists, compiled once from the Plan's ops
    cpu: Mapping[str, Any] | None = None  # static: the CPU facts it decided by
    loss_scaling: str | None = None  # static: "none" (bf16 Programs are not scaled)


def is_program(model: Any) -> bool:
    static = sys.modules.get("paddle.static")
    return static is not None and isinstance(model, static.Program)


def default_place(load: bool = False) -> str:
    """``"gpu"`` when Paddle's current device is a GPU, else ``"cpu"`` (paddle not imported, unless ``load``: cpu)."""
    paddle = __import__("paddle") if load else sys.modules.get("paddle")
    return "gpu" if paddle is not None and paddle.device.get_device().startswith("gpu") else "cpu"


def model_place(model: Any) -> str:
    """``"gpu"`` when the layer's parameters (or Paddle's current device) are on a GPU, else ``"cpu"``."""
    for p in model.parameters():
        return "gpu" if p.place.is_gpu_place() else "cpu"
    return default_place()


def compile_plan(request: PlanRequest, model: Any = None) -> Plan:
    """The Plan of ``request`` for ``model``: a legacy-IR Program (static) or a Layer (dygraph, on its place)."""
    if model is not None and is_program(model):
        return compile_static(request)
    if model is None:
        return compile_dygraph(request, default_place())
    return compile_dygraph(request, model_place(model), model_index(model))


def _compile(request: PlanRequest, low: str, reason: str, active: bool, why: str,
             fixed_extra: dict[str, tuple[str | None, str]], problems: list[str], details: PaddleDetails,
             notes: tuple[str, ...], param_fallback: str | None = None,
             override_fallbacks: Mapping[int, str] | None = None, index: Iterable[LayerInfo] | None = None) -> Plan:
    fixed = dict(fixed_extra)
    control = {}
    for d in request.ops:
        if not active and dtypes.is_low(request.requested(d.op, low)):
            fixed[d.op] = ("float32", why)
        if active and d.op not in fixed_extra and (op_types(d.op) or layer_types(d.op)):
            # Paddle's Linear runs matmul_v2: controllable per layer, not per op type
            control[d.op] = "op" if op_types(d.op) and d.op != "linear" else "layer"
    native = {d.op: tuple(sorted(op_types(d.op) | layer_types(d.op))) for d in request.ops}
    return request.compile(control=control, native=native, compute_dtype=low, compute_reason=reason, fixed=fixed,
                           notes=notes, details=details, index=index, param_fallback=param_fallback,
                           override_fallbacks=override_fallbacks, fp8=Fp8Support(missing=FP8_MISSING),
                           problems=problems, fix=FIX)


def amp_support(place: str, dtype: str) -> tuple[bool, str]:
    """Whether Paddle's dygraph AMP really runs ``dtype`` on ``place`` (``cpu``/``gpu``/...)."""
    if dtype == "float32":
        return False, "float32 requested"
    if place != "gpu":
        return False, CPU_WHY if place == "cpu" else f"unimp-paddle drives AMP on CUDA only (place {place})"
    import paddle

    ok = paddle.amp.is_bfloat16_supported() if dtype == "bfloat16" else paddle.amp.is_float16_supported()
    return bool(ok), (f"Paddle reports {dtype} AMP available on this GPU" if ok else
                      f"Paddle reports no {dtype} AMP on this GPU; it runs float32")


def compile_dygraph(request: PlanRequest, place: str, index: Iterable[LayerInfo] | None = None) -> Plan:
    """The Plan for a ``paddle.nn.Layer`` on ``place`` (``"cpu"`` or ``"gpu"``; ``index``: its layers)."""
    low, reason = request.compute_dtype, "as the policy says"
    if low == "auto":
        if place == "gpu":
            low, reason = hardware.resolve_auto(fast_bf16=amp_support("gpu", "bfloat16")[0],
                                                fast_fp16=amp_support("gpu", "float16")[0],
                                                where="this GPU (Paddle AMP)")
        else:
            low, reason = "float32", f"auto: {CPU_WHY}"
    active, why = amp_support(place, low)
    lists = compile_lists(request)
    problems = []
    param_fallback: str | None = None  # what low-precision params really hold, when not lowered
    override_fallbacks: dict[int, str] = {}  # override index -> dtype its layers really compute in
    o2 = dtypes.is_low(request.param_dtype)
    if not active and o2:
        problems.append(f"param_dtype = {request.param_dtype!r} (O2): {why}; params stay float32")
        param_fallback = "float32"
    for r in request.at(low).override_dtypes:
        if not dtypes.is_low(r.dtype):
            continue
        ok, reason = amp_support(place, r.dtype)
        if r.key == "param_dtype" and ok and active and not o2:
            ok, reason = False, "unimp-paddle lowers params only at O2 (policy param_dtype low, paddle.amp.decorate)"
        if not ok or not active:
            reason = reason if not ok else "unimp-paddle enables AMP only when compute_dtype is low"
            problems.append(f"{r.setting} = {r.dtype!r}: {reason}; the matched layers run float32")
            if r.key == "compute_dtype":
                override_fallbacks[r.override] = "float32"
            else:
                param_fallback = "float32"
    details = PaddleDetails("dygraph", place, active, low, request.param_dtype if active else "float32",
                            "O2" if o2 else "O1", lists)
    notes = ("Paddle has no 'follow inputs' list: ops in neither list (promote and follow-inputs) are "
             "Paddle's gray ops, which run in the promoted dtype of their inputs",)
    return _compile(request, low, reason, active, why, {}, problems, details, notes,
                    param_fallback, override_fallbacks, index)


def compile_static(request: PlanRequest) -> Plan:
    """The Plan for a legacy-IR ``paddle.static.Program`` (bf16 rewrite, runs on CPU)."""
    low, reason = request.compute_dtype, "as the policy says"
    facts = hardware.cpu()
    if low == "auto":
        low, reason = hardware.resolve_cpu_auto("Paddle's static bf16 rewrite (oneDNN)", facts)
    problems = []
    param_fallback = None
    active, why = low == "bfloat16", ""
    if active and not facts.bf16_kernels:
        active, why = False, (f"Paddle's oneDNN has no bfloat16 matmul kernel on this CPU, {facts.describe()} "
                              f"(it needs AVX512 BW/VL/DQ or AVX-NE-CONVERT; Paddle would fail with 'could not "
                              f"create a primitive descriptor'), so unimp runs it in float32")
    elif request.compute_dtype == "bfloat16" and hardware.warn_emulated(low, "compute_dtype", "Paddle (oneDNN)"):
        reason += f" (emulated on this CPU, slower than float32: {facts.describe()})"
    if low == "float16":
        why = ("the static path rewrites to bfloat16 only (decorate_bf16); Paddle has no CPU float16 "
               "kernels, so Paddle runs it in float32")
    fixed_extra: dict[str, tuple[str | None, str]] = {
        op: ("float32", broken) for op, broken in STATIC_BF16_BROKEN.items()
        if active and request.requested(op, low) != "float32"}
    if dtypes.is_low(request.param_dtype):
        problems.append(f"param_dtype = {request.param_dtype!r}: unimp-paddle's static path keeps float32 "
                        f"params (pure bf16 Programs are not supported yet); params stay float32")
        param_fallback = "float32"
    request = request.at(low)
    scaling = request.loss_scale.mode
    if scaling != "none":
        problems.append(f"loss_scale.mode = {scaling!r}: unimp-paddle does not insert loss "
                        f"scaling into static Programs (bf16 does not need it); no scaling is applied")
    problems += [f"{r.setting} = {'auto' if r.follows_compute else r.dtype!r}: static overrides (by parameter "
                 f"name) can only keep ops float32; the matched layers run float32" for r in request.override_dtypes
                 if dtypes.is_low(r.dtype) or (r.key == "compute_dtype" and r.follows_compute)]
    details = PaddleDetails("static", "cpu", active, low, "float32", lists=compile_lists(request),
                            cpu=facts.record(), loss_scaling="none")
    notes = ("static gray ops run float32 if any producer is float32, else bfloat16 if any is bfloat16",)
    return _compile(request, low, reason, active, why, fixed_extra, problems, details, notes, param_fallback)
