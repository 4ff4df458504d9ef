"""The ipex backend class (the ``unimp.backends`` entry point). Importing it imports neither torch nor IPEX.

Chosen over the torch backend for torch models on CPU (``priority``); runs them through IPEX
where it can be imported and through torch's CPU autocast otherwise, and the Plan says which.

>>> IpexBackend.name, IpexBackend.priority > 0
('ipex', True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from unimp.spi import Plan, PlanRequest, hardware
from unimp_torch.extension import TorchBackend


class IpexBackend(TorchBackend):
    """``unimp.apply(policy, model, optimizer)`` for ``torch.nn.Module`` models on CPU.

    ``apply`` options: ``engine`` = ``"auto"`` (IPEX when installed for this torch, else torch),
    ``"ipex"`` or ``"torch"``; ``on_skip`` as in unimp-torch.
    """

    name: ClassVar[str] = "ipex"
    distribution: ClassVar[str] = "unimp-ipex"
    model_types: ClassVar[str] = "torch.nn.Module on CPU"
    priority: ClassVar[int] = 10

    def accepts(self, model: Any) -> bool:
        if not super().accepts(model):
            return False
        return all(t.device.type == "cpu" for t in (*model.parameters(), *model.buffers()))

    def plan(self, request: PlanRequest, model: Any = None, *, engine: str = "auto") -> Plan:
        from .engine import find_engine
        from .plan import compile_plan

        return compile_plan(request, model, find_engine(engine), hardware.cpu())

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, *, engine: str = "auto",
              on_skip: Callable[[], Any] | None = None, **options: Any) -> Any:
        """Bind ``plan`` (its model part redone when it was compiled without ``model`` or for another engine);
        see the class docstring."""
        from unimp_torch.extension import check_inputs

        from .amp import apply_plan

        if options:
            raise TypeError(f"unimp.apply(...) for ipex got unknown options {sorted(options)}; it accepts "
                            f"engine='auto'|'ipex'|'torch' and on_skip=callable")
        device = check_inputs(model, optimizer, on_skip)
        if isinstance(optimizer, list | tuple):
            from unimp.spi import UnsupportedError

            raise UnsupportedError("optimizer: backend 'ipex' binds one optimizer (ipex.optimize takes one); pass "
                                   "one, or use backend='torch' for several optimizers sharing one loss scale")
        if device != "cpu":
            from unimp.spi import UnsupportedError

            raise UnsupportedError(f"model: backend 'ipex' runs CPU models, this one is on {device}; "
                                   f"use backend='torch' (or model.to('cpu'))")
        from .engine import find_engine
        from .plan import on_engine

        if not plan.layers or plan.details.engine != find_engine(engine).name:
            plan = on_engine(plan, model, find_engine(engine), hardware.cpu())
        return apply_plan(plan, model, optimizer, on_skip)

    def conformance_kit(self) -> Any:
        from .testing import IpexKit

        return IpexKit()
