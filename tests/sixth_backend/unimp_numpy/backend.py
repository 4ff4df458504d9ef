"""The NumPy backend class: a declarative description (native op table, tags) plus plan/apply.

>>> import unimp
>>> plan = NumpyBackend().compile(unimp.load("fp32"))
>>> plan.compute_dtype, plan.op("linear").control
('float32', 'layer')
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from unimp.spi import Amp, Backend, Plan, PlanRequest

from .index import NATIVE
from .plan import compile_plan


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

    def plan(self, request: PlanRequest, model: Any = None) -> Plan:
        return compile_plan(request, self.native_ops, model)

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        from .amp import NumpyAmp

        if options:
            raise TypeError(f"unimp.apply: unknown options for the numpy backend: {sorted(options)}")
        return NumpyAmp(plan, model, optimizer)
