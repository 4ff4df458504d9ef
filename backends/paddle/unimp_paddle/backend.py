"""The Paddle backend class (entry point ``unimp.backends: paddle``); imports paddle lazily.

>>> from unimp_paddle.backend import PaddleBackend
>>> PaddleBackend.framework
'paddle'
"""

from __future__ import annotations

import sys
from typing import Any

from unimp.spi import Amp, Backend, Plan, Policy


def _is_program(model: Any) -> bool:
    static = sys.modules.get("paddle.static")
    return static is not None and isinstance(model, static.Program)


def model_place(model: Any) -> str:
    """``"gpu"`` when the layer's parameters (or Paddle's current device) are on a GPU, else ``"cpu"``."""
    import paddle

    for p in model.parameters():
        return "gpu" if p.place.is_gpu_place() else "cpu"
    return "gpu" if paddle.device.get_device().startswith("gpu") else "cpu"


class PaddleBackend(Backend):
    """``paddle.nn.Layer`` (dygraph AMP) and legacy-IR ``paddle.static.Program`` (bf16 rewrite)."""

    name = "paddle"
    framework = "paddle"
    distribution = "unimp-paddle"
    model_types = "paddle.nn.Layer or paddle.static.Program (legacy IR)"

    def accepts(self, model: Any) -> bool:
        import paddle

        return isinstance(model, paddle.nn.Layer) or _is_program(model)

    def compile(self, policy: Policy, model: Any = None) -> Plan:
        from .plan import compile_dygraph, compile_static

        if model is not None and _is_program(model):
            return compile_static(policy)
        place = model_place(model) if model is not None else _default_place()
        return compile_dygraph(policy, place)

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        if _is_program(model):
            from .static import StaticAmp

            return StaticAmp(plan, model, optimizer, **options)
        from .amp import DygraphAmp

        return DygraphAmp(plan, model, optimizer, **options)

    def conformance_kit(self) -> Any:
        from .testing import PaddleKit

        return PaddleKit()


def _default_place() -> str:
    if "paddle" not in sys.modules:
        return "cpu"
    import paddle

    return "gpu" if paddle.device.get_device().startswith("gpu") else "cpu"
