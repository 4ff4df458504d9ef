"""Optimizers that step an applied model's parameters around unimp, refused at their first step.

An unwrapped optimizer would apply the *scaled* gradient under a scaling policy, or lose its update at the next
copy from the fp32 masters; so would a wrapped optimizer stepped directly (not ``amp.optimizers[i]``). These are
refused with an :class:`unimp.errors.UnsupportedError` naming the fix, before anything changes; with no scaling
and no masters (``mixed_bf16``) any optimizer is let through. One global ``torch.optim`` step pre-hook does it
(a dictionary lookup per step; each optimizer checked once, again only after an ``apply`` or ``remove``).

>>> import torch, unimp
>>> m = torch.nn.Linear(2, 2)
>>> amp = unimp.apply("mixed_fp16", m)
>>> stray = torch.optim.SGD(m.parameters(), lr=0.1)
>>> amp.backward(m(torch.randn(3, 2)).sum())
>>> stray.step()  # doctest: +ELLIPSIS
Traceback (most recent call last):
unimp.errors.UnsupportedError: SGD.step(): this optimizer steps 'weight' of a Linear under the unimp policy ...
>>> _ = amp.remove()
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from unimp.spi import UnsupportedError, strays

from .optimizer import AmpOptimizer


def _install() -> None:
    register_optimizer_step_pre_hook(_pre_step)  # kept for the process: per step a dictionary lookup


_guard = strays.Guard(_install)  # live TorchAmps, the inner optimizers of their wrappers, checked optimizers


def watch(amp: Any) -> None:
    """Guard ``amp``'s model from unwrapped optimizers (the hook registered once per process)."""
    _guard.watch(amp)


def wrapped(amp: Any, optimizer: Any) -> None:
    """``optimizer`` (an AmpOptimizer of ``amp``) wraps ``optimizer.optimizer``: its inner steps come from it."""
    _guard.wrap(optimizer.optimizer, optimizer, amp)


def unwatch(amp: Any) -> None:
    """``amp`` was removed: its model and optimizers are plain again."""
    _guard.unwatch(amp, [(opt.optimizer, opt) for opt in getattr(amp, "optimizers", [])])


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if isinstance(optimizer, AmpOptimizer):
        return
    if _guard.owner(optimizer) is not None:  # passed to unimp.apply: refused only when stepped around its wrapper
        owner = _guard.stepped_around(optimizer)
        if owner is not None:
            _refuse_direct(optimizer, owner)
        return
    _guard.check(optimizer, lambda amp: _problem(amp, optimizer))


def _problem(amp: Any, optimizer: torch.optim.Optimizer) -> UnsupportedError | None:
    scaled = amp.scaler.spec.mode != "none"
    if not strays.at_risk(scaled, bool(amp.params.home)):  # nothing goes wrong
        return None
    names = {id(p): n for n, p in amp.module.named_parameters()}
    names |= {id(orig): n + " (its fp32 original)" for n, p in amp.module.named_parameters()
              if (orig := amp.params.home.get(id(p), (None, None))[1]) is not None}
    hit = next((names[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in names), None)
    if hit is None:
        return None
    return strays.unwrapped(f"{type(optimizer).__name__}.step()", hit, type(amp.module).__name__, amp.plan.name,
                            scaled, amp.scaler.scale.item() if scaled else None)


def _refuse_direct(optimizer: torch.optim.Optimizer, owner: Any) -> None:
    scaled = owner.scaler.spec.mode != "none"
    if strays.at_risk(scaled, bool(owner.masters)):
        raise strays.direct(f"{type(optimizer).__name__}.step()", scaled)
