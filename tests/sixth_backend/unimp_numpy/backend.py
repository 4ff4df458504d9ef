"""The NumPy backend class: a declarative description (native op table, tags) plus compile/apply.

>>> import unimp
>>> plan = NumpyBackend().compile(unimp.load("fp32"))
>>> plan.compute_dtype, plan.op("linear").control
('float32', 'layer')
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from unimp.spi import (
    Amp,
    Backend,
    Plan,
    Policy,
    UnsupportedError,
    compile_ops,
    resolve_cpu_auto,
)

from .index import NATIVE, model_index


class NumpyBackend(Backend):
    name = "numpy"
    framework = "unimp_numpy.nn"
    distribution = "unimp-numpy"
    model_types = "unimp_numpy.nn.Model"
    native_ops: ClassVar = NATIVE
    tags: ClassVar = frozenset({"fp16", "training", "loss_scaling", "overrides", "layout", "layer_level", "remove"})

    def accepts(self, model: Any) -> bool:
        nn = sys.modules.get(self.framework)
        return nn is not None and isinstance(model, nn.Model)

    def compile(self, policy: Policy, model: Any = None) -> Plan:
        if policy.compute_dtype == "auto":
            compute, reason = resolve_cpu_auto("numpy", bf16=False, fp16=False,
                                               why_not="numpy has no bfloat16 dtype and emulates float16")
        else:
            compute, reason = policy.compute_dtype, "as the policy says"
        wanted = {compute, policy.param_dtype, *(o.compute_dtype for o in policy.overrides),
                  *(o.param_dtype for o in policy.overrides)}
        if "bfloat16" in wanted:
            raise UnsupportedError(f"policy {policy.name!r}: the numpy backend has no bfloat16 (numpy has no such "
                                   f"dtype); fix: use float16 or float32")
        if policy.low_precision_params or any(o.param_dtype not in (None, "float32") for o in policy.overrides):
            raise UnsupportedError(f"policy {policy.name!r}: the numpy backend keeps params in float32; fix: set "
                                   f"param_dtype = \"float32\"")
        control = {op: "layer" for op, names in self.native_ops.items() if names}
        return compile_ops(self.name, policy, control=control, native=self.native_ops, compute_dtype=compute,
                           compute_reason=reason, index=model_index(model) if model is not None else None)

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        from .amp import NumpyAmp

        if options:
            raise TypeError(f"unimp.apply: unknown options for the numpy backend: {sorted(options)}")
        return NumpyAmp(plan, model, optimizer)
