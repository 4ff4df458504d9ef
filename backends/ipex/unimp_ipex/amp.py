"""``IpexAmp``: unimp-torch's Amp on the IPEX-optimized copy, answering for the user's model.

>>> import torch, unimp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> amp = unimp.apply("mixed_bf16", model, torch.optim.Adam(model.parameters()), backend="ipex")
>>> loss = amp.model(torch.randn(4, 8)).square().mean()
>>> amp.backward(loss); amp.optimizer.step(); amp.optimizer.zero_grad()
>>> amp.report().row("0").compute_dtype, amp.remove() is model
('bfloat16', True)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from unimp.spi import Amp, LossScaleState, Plan, Report, UnsupportedError
from unimp_torch.extension import NAMES, TorchAmp, bind, kind, type_names

from .optimizer import ipex_masters, optimize, param_dtypes, write_back
from .trace import user_rows


class IpexAmp(Amp):
    """The handle ``unimp.apply(..., backend="ipex")`` returns; the verbs are unimp-torch's.

    ``model``/``optimizer`` are what to train with (IPEX's optimized copies when the engine is
    ipex); ``remove()`` returns the model the user passed in, with the trained values.
    """

    def __init__(self, plan: Plan, original: nn.Module, inner: TorchAmp, findings: list[str]) -> None:
        super().__init__(plan, inner.model, inner.optimizer)
        self.original = original
        self.inner = inner
        self.findings = findings
        self._masters = ipex_masters(inner.model, inner.inner_optimizer) if inner.model is not original else []

    # ------------------------------------------------------------------ verbs (unimp-torch's)
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.inner.backward(loss, **kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.inner.scale_loss(loss)

    def unscale_(self) -> torch.Tensor | None:
        return self.inner.unscale_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, **kwargs: Any) -> torch.Tensor:
        """Clip unscaled gradients; under IPEX masters the grads live on the bf16 params."""
        if not self._masters:
            return self.inner.clip_grad_norm_(max_norm, norm_type, **kwargs)
        self.inner._check_live("amp.clip_grad_norm_()")
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, **kwargs)

    @property
    def master_weights(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """``(name, low-precision param, fp32 master)``: IPEX's masters and unimp-torch's."""
        return self._masters + self.inner.master_weights

    @property
    def wrapped(self) -> list[str]:
        return self.inner.wrapped

    # ------------------------------------------------------------------ Amp contract
    def loss_scale_state(self) -> LossScaleState:
        return self.inner.loss_scale_state()

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        self.inner.set_loss_scale_state(state)

    def report(self, *args: Any, **kwargs: Any) -> Report:
        """unimp-torch's report of what ran, with layer kinds named from the user's model."""
        rows = user_rows(self.inner.report(*args, **kwargs).rows, self.original)
        notes = [self.plan.notes[0]] + ([self.plan.notes[1]] if self.plan.details.ipex else [])
        return self.report_header(rows, notes + [f"wrapped per layer: {', '.join(self.wrapped)}"] * bool(self.wrapped))

    def _restore(self) -> None:
        trained = self.inner.scaler.steps > 0
        self.inner.remove()
        if self.inner.model is not self.original and trained:
            write_back(self.original, self.inner.model)
        self.model = self.original  # amp.optimizer stays: its verbs refuse once removed


def apply_plan(plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               on_skip: Callable[[], Any] | None) -> IpexAmp:
    """Bind ``plan`` (with the user's layers indexed): ``ipex.optimize`` a copy when the engine is ipex, then
    unimp-torch's ``bind`` (the layout findings acted on once, here)."""
    findings = list(plan.layout.act("ipex"))
    inner_plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, action="ignore"))
    target, opt = model, optimizer
    ipex = plan.details.ipex
    if ipex is not None:
        if optimizer is None and model.training:
            raise UnsupportedError("optimizer: ipex.optimize treats a model in training mode as training and "
                                   "needs its optimizer; pass the optimizer, call model.eval() first for "
                                   "inference, or pass engine='torch'")
        target, opt = optimize(model, optimizer, ipex.kwargs())  # opt: None without an optimizer
        if ipex.dtype == "bfloat16":
            _verify_bf16(plan, model, target)
    inner = bind(inner_plan, target, opt, "cpu", on_skip)
    return IpexAmp(plan, model, inner, findings)


def _verify_bf16(plan: Plan, original: nn.Module, optimized: nn.Module) -> None:
    """Every param IPEX made bf16 must be one the policy wants in bf16 (unimp-torch casts the rest)."""
    wrong = []
    for name, dtype in param_dtypes(optimized).items():
        m = original.get_submodule(path := name.rpartition(".")[0])
        want = plan.decide(path, kind(m), type_names(m)).param_dtype
        if NAMES.get(dtype) == "bfloat16" != want:
            wrong.append(f"{name}: {NAMES.get(dtype, dtype)} (policy: {want})")
    if wrong:
        raise RuntimeError("unimp-ipex: ipex.optimize(dtype=bfloat16) gave dtypes the policy does not ask "
                           "for: " + "; ".join(wrong) + ". Pass engine='torch' to unimp.apply and report "
                           "this model to unimp-ipex")
