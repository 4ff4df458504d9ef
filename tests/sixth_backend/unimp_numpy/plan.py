"""The request (the policy as asked) -> the NumPy backend's Plan: what it controls, per layer.

>>> import unimp
>>> from unimp_numpy.index import NATIVE
>>> plan = compile_plan(Plan.request(unimp.load("mixed_fp16"), "numpy"), NATIVE)
>>> plan.compute_dtype, plan.op("linear").control, plan.op("softmax").control
('float16', 'layer', 'fixed')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.spi import Plan, PlanRequest, UnsupportedError, hardware

from .index import model_index


def compile_plan(request: PlanRequest, native: Mapping[str, tuple[str, ...]], model: Any = None) -> Plan:
    """The Plan: float16 or float32 compute per layer (numpy has no bfloat16), params kept in float32."""
    if request.compute_dtype == "auto":
        compute, reason = hardware.resolve_cpu_auto("numpy", bf16=False, fp16=False,
                                                    why_not="numpy has no bfloat16 dtype and emulates float16")
    else:
        compute, reason = request.compute_dtype, "as the policy says"
    request = request.at(compute)
    overrides = request.override_dtypes  # resolved by the core: "auto" is the compute dtype
    if "bfloat16" in {compute, request.param_dtype, *(r.dtype for r in overrides)}:
        raise UnsupportedError(f"{request.where}: the numpy backend has no bfloat16 (numpy has no such dtype); "
                               f"fix: use float16 or float32")
    if request.low_precision_params or any(r.key == "param_dtype" and r.dtype != "float32" for r in overrides):
        raise UnsupportedError(f"{request.where}: the numpy backend keeps params in float32; fix: set "
                               f"param_dtype = \"float32\"")
    control = {op: "layer" for op, names in native.items() if names}
    return request.compile(control=control, native=native, compute_reason=reason,
                           index=model_index(model) if model is not None else None)
