"""The torch backend class (the ``unimp.backends`` entry point). Importing it does not import torch.

>>> TorchBackend.name, TorchBackend.framework, TorchBackend.priority
('torch', 'torch', 0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from unimp.spi import Amp, Backend, Plan, PlanRequest, Snapshot, UnsupportedError, ops

from .ops import NATIVE_OPS


class TorchBackend(Backend):
    """``unimp.apply(policy, model, optimizer)`` for any ``torch.nn.Module`` on cpu or cuda."""

    name: ClassVar[str] = "torch"
    framework: ClassVar[str] = "torch"
    distribution: ClassVar[str] = "unimp-torch"
    model_types: ClassVar[str] = "torch.nn.Module"
    priority: ClassVar[int] = 0
    native_ops: ClassVar = ops.native_table("torch", NATIVE_OPS)
    tags: ClassVar = frozenset({"fp16", "bf16", "master_weights", "loss_scaling", "training", "overrides", "layout",
                                "op_level", "layer_level", "distributed", "remove"})

    def accepts(self, model: Any) -> bool:
        import torch

        return isinstance(model, torch.nn.Module)

    def plan(self, request: PlanRequest, model: Any = None) -> Plan:
        from .plan import compile_plan

        return compile_plan(request, model)

    def snapshot(self, model: Any, optimizer: Any = None, plan: Plan | None = None) -> Snapshot:
        """Every module's attributes (parameters, buffers, submodules, forward, hooks), every parameter's and buffer's
        storage, and the optimizer's groups and state: a failed apply leaves them as they were."""
        import torch

        modules = list(model.modules()) if isinstance(model, torch.nn.Module) else [model]
        tensors = {id(t): t for m in modules if isinstance(m, torch.nn.Module)
                   for t in (*m._parameters.values(), *m._buffers.values()) if isinstance(t, torch.Tensor)}

        def value(t: Any) -> tuple[Callable[[], Any], Callable[[Any], None]]:
            return (lambda: t.data), (lambda data: setattr(t, "data", data))

        from .validate import as_list

        return Snapshot([*modules, *as_list(optimizer)], [value(t) for t in tensors.values()])

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, *,
              on_skip: Callable[[], Any] | None = None, share_scale_with: Any = None, **options: Any) -> Any:
        """Bind ``plan``; ``optimizer``: one ``torch.optim.Optimizer`` or a list of them (one loss scale,
        :mod:`unimp_torch.iteration`); ``on_skip()`` is called after every skipped optimizer step;
        ``share_scale_with``: another torch Amp whose loss scale (and iteration) this model's optimizers
        share, as one ``torch.amp.GradScaler`` serves two models (a GAN's generator and discriminator)."""
        from .amp import TorchAmp, bind
        from .distributed import attach_ddp, check_ddp_order, is_ddp, is_fsdp
        from .validate import check_inputs

        if options:
            raise TypeError(f"unimp.apply(...) for torch got unknown options {sorted(options)}; "
                            f"it accepts on_skip=callable, share_scale_with=amp")
        device = check_inputs(model, optimizer, on_skip)
        if share_scale_with is not None:
            _check_shared(share_scale_with, plan, TorchAmp)
        if plan.details.device != device:
            raise UnsupportedError(f"unimp-torch: this Plan was compiled for {plan.details.device}, the model is on "
                                   f"{device}; compile it with the model: backend.compile(policy, model)")
        # a torch.compile wrapper and/or a DDP built first: bind the module inside (the wrapper marked bound too)
        inner = _compiled_inner(model)
        ddp = inner if is_ddp(inner) else None
        inner = ddp.module if ddp is not None else inner
        if inner is not model and Amp.is_bound(inner):
            raise RuntimeError("unimp.apply: the module inside this " + (
                "DistributedDataParallel already has a unimp policy applied; use that Amp (amp.ddp() wraps it)"
                if ddp is not None else "torch.compile wrapper already has a unimp policy applied; use that Amp "
                                        "(its amp.model can be compiled)"))
        if ddp is not None:
            check_ddp_order(plan, ddp)
        amp = bind(plan, inner, optimizer, device, on_skip, fsdp=ddp is None and is_fsdp(inner),
                   shared=share_scale_with)
        if ddp is not None:
            try:
                attach_ddp(amp, ddp, owned=False)
            except BaseException:
                amp._restore()
                raise
        if inner is not model:
            amp.bind_also(inner, ddp)
            amp.model = model
        return amp

    def conformance_kit(self) -> Any:
        from .testing import TorchKit

        return TorchKit()

    def tuning(self) -> Any:
        """What ``unimp.tune`` measures through torch: GEMM shapes, the FP8 GEMM microbenchmark, Hessian traces."""
        from .tuning import TorchTuning

        return TorchTuning()


def _check_shared(other: Any, plan: Plan, amp_type: type[Any]) -> None:
    """``share_scale_with``: a live torch Amp whose loss-scale rule is this Plan's (one scale, one rule)."""
    if not isinstance(other, amp_type):
        raise TypeError(f"share_scale_with: expected the Amp unimp.apply returned for another torch model, got "
                        f"{type(other).__name__}")
    other._check_live("unimp.apply(..., share_scale_with=amp)")
    if other.plan.loss_scale != plan.loss_scale:
        raise UnsupportedError(f"share_scale_with: that Amp's loss-scale rule ({other.plan.where}) differs "
                               f"from this one's ({plan.where}); one shared scale runs one rule: apply the "
                               f"same loss_scale section to both models")


def _compiled_inner(model: Any) -> Any:
    """The module a ``torch.compile(module)`` wrapper (``OptimizedModule``) holds, else ``model``."""
    from torch._dynamo.eval_frame import OptimizedModule

    return model._orig_mod if isinstance(model, OptimizedModule) else model
