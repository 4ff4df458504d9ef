"""The conformance kit for backend ``ipex``: unimp-torch's probe and training step, IPEX's masters.

>>> IpexKit().backend
'ipex'
"""

from __future__ import annotations

from typing import Any

from unimp.spi import Plan, PlanRequest, hardware
from unimp_torch.extension import TorchKit


class IpexKit(TorchKit):
    """``engine``: ``auto`` (IPEX when installed) or ``torch`` (the no-IPEX path)."""

    backend = "ipex"

    def __init__(self, engine: str = "auto") -> None:
        super().__init__("cpu")
        self.engine = engine

    def supports(self, request: PlanRequest) -> str | None:
        cpu = hardware.cpu()
        if any(d == "float16" for _, d in request.compute_requests()) and not cpu.native_fp16:
            return f"float16 on a CPU without AVX512-FP16/AMX-FP16 ({cpu.describe()})"
        return None

    def apply(self, policy: Any, model: Any, optimizer: Any) -> Any:
        from unimp.spi import apply

        return apply(policy, model, optimizer, backend="ipex", engine=self.engine)

    def compile(self, policy: Any, model: Any) -> Any:
        return self.backend_instance().plan(Plan.request(policy, self.backend), model, engine=self.engine)

    def apply_plan(self, plan: Any, model: Any, optimizer: Any) -> Any:
        return self.backend_instance().apply(plan, model, optimizer, engine=self.engine)
