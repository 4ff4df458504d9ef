"""Parameter dtypes per the policy, fp32 master weights, and their exact undo.

With master weights, the user's fp32 ``Parameter`` objects stay in the optimizer as masters and
the model gets new low-precision parameters (weight ties kept); without them, parameters are
cast in place. ``restore()`` puts everything back (after training, the masters' values).

>>> import torch, unimp
>>> m = torch.nn.Linear(4, 4)
>>> w = m.weight
>>> st = cast_params(m, unimp.load("pure_bf16"), "bfloat16", {id(w), id(m.bias)})
>>> m.weight.dtype, st.masters[0][2] is w
(torch.bfloat16, True)
>>> st.restore(trained=False); m.weight is w
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from unimp.policy import Policy

from .layers import DTYPES, kind, type_names


@dataclass
class ParamState:
    """What :func:`cast_params` changed; ``masters`` is ``(name, low param, fp32 master)``."""

    masters: list[tuple[str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)
    in_place: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)

    def sync_low(self) -> None:
        """Low-precision params := cast(master), after every optimizer step."""
        if self.masters:
            lows = [low.data for _, low, _ in self.masters]
            torch._foreach_copy_(lows, [m.data for _, _, m in self.masters])

    def restore(self, trained: bool) -> None:
        for module, name, original in reversed(self.swapped):
            module._parameters[name] = original
        for p, original in reversed(self.in_place):
            p.data = p.data.to(original.dtype) if trained else original
        self.swapped.clear()
        self.in_place.clear()
        self.masters.clear()


def cast_params(model: nn.Module, policy: Policy, low: str, optimized: set[int]) -> ParamState:
    """Give every parameter the policy's param dtype; masters for those in ``optimized`` (ids)."""
    state = ParamState()
    masters = policy.uses_master_weights
    done: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules():
        decision = policy.decide(path, kind(module), type_names(module), low)
        dtype = DTYPES[decision.param_dtype]
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == torch.float64:
                continue
            if id(p) in done:  # a tied weight: same object as before
                module._parameters[name] = done[id(p)]
                state.swapped.append((module, name, p))
                continue
            if p.dtype == dtype:
                continue
            qualified = f"{path}.{name}" if path else name
            if masters and id(p) in optimized:
                new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new
                done[id(p)] = new
                state.swapped.append((module, name, p))
                state.masters.append((qualified, new, p))
            elif masters:  # frozen: no master needed, but keep the original for restore
                new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new
                done[id(p)] = new
                state.swapped.append((module, name, p))
            else:
                state.in_place.append((p, p.data))
                p.data = p.data.to(dtype)
    return state
