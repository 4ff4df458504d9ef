"""The Paddle backend class (entry point ``unimp.backends: paddle``); imports paddle lazily.

>>> from unimp_paddle.backend import PaddleBackend
>>> PaddleBackend.framework
'paddle'
"""

from __future__ import annotations

from typing import Any, ClassVar

from unimp.spi import Amp, Backend, Plan, PlanRequest, Snapshot, ops

from .ops import NATIVE_OPS
from .plan import compile_plan, is_program


class PaddleBackend(Backend):
    """``paddle.nn.Layer`` (dygraph AMP) and legacy-IR ``paddle.static.Program`` (bf16 rewrite)."""

    name = "paddle"
    framework = "paddle"
    distribution = "unimp-paddle"
    model_types = "paddle.nn.Layer or paddle.static.Program (legacy IR)"
    native_ops: ClassVar = ops.native_table("paddle", NATIVE_OPS)
    tags: ClassVar = frozenset({"fp16", "bf16", "master_weights", "loss_scaling", "training", "overrides", "layout",
                                "op_level", "layer_level", "static_graph", "distributed", "remove"})

    def accepts(self, model: Any) -> bool:
        import paddle

        return isinstance(model, paddle.nn.Layer) or is_program(model)

    def plan(self, request: PlanRequest, model: Any = None) -> Plan:
        return compile_plan(request, model)

    def snapshot(self, model: Any, optimizer: Any = None, plan: Plan | None = None) -> Snapshot:
        """A dygraph Layer: every sublayer's attributes (forwards, hooks) and the optimizer's; when the Plan runs
        O2 (``decorate`` casts parameters in place), every parameter's and buffer's dtype and value (copied) too."""
        if is_program(model):
            return Snapshot([model, optimizer])
        layers = [model, *model.sublayers()]
        o2 = plan is None or (plan.details.amp_active and plan.details.level == "O2")
        tensors = {id(t): t for layer in layers for t in (*layer._parameters.values(), *layer._buffers.values())
                   if t is not None} if o2 else {}
        return Snapshot([*layers, optimizer], [_value(t) for t in tensors.values()])

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        if is_program(model):
            from .static import PaddleStaticAmp

            return PaddleStaticAmp(plan, model, optimizer, **options)
        from .amp import PaddleAmp

        return PaddleAmp(plan, model, optimizer, **options)

    def conformance_kit(self) -> Any:
        from .testing import PaddleKit

        return PaddleKit()


def _value(t: Any) -> tuple[Any, Any]:
    """``(get, put)`` of a paddle tensor's dtype and bits (a copy: O2 casts tensors in place)."""
    import paddle

    def get() -> tuple[Any, Any]:
        return t.dtype, t.numpy().copy()

    def put(saved: tuple[Any, Any]) -> None:
        dtype, value = saved
        if t.dtype != dtype:
            t._to(dtype=dtype)
        with paddle.no_grad():
            t.set_value(paddle.to_tensor(value, dtype=dtype))

    return get, put
