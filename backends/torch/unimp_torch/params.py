"""Parameter dtypes per the policy, fp32 master weights, and their exact undo.

With master weights the user's fp32 ``Parameter`` objects stay in the optimizer as masters and the model gets new
low-precision parameters (weight ties kept); without, parameters are cast in place. While applied, the model's
``state_dict()``/``load_state_dict()`` hold the fp32 originals; ``restore()`` puts everything back.

>>> import torch, unimp
>>> from unimp.spi import Plan
>>> from unimp_torch.plan import compile_plan
>>> m = torch.nn.Linear(4, 4)
>>> w = m.weight
>>> st = cast_params(m, compile_plan(Plan.request(unimp.load("pure_bf16"), "torch"), m), {id(w), id(m.bias)})
>>> m.weight.dtype, st.masters[0][2] is w, m.state_dict()["weight"].dtype
(torch.bfloat16, True, torch.float32)
>>> st.restore(); m.weight is w
True
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from unimp.spi import Plan, UnsupportedError

from .casts import DTYPES
from .kinds import kind, type_names


@dataclass
class ParamState:
    """What :func:`cast_params` changed; ``masters`` is ``(name, low param, fp32 master)``.

    ``swapped`` is ``(module, name, original, low)`` for every parameter slot given a new
    low-precision ``Parameter`` (tied slots once each); ``home`` maps ``id(low)`` to
    ``(low, original)``: the fp32 tensor that is the parameter's true value.
    """

    masters: list[tuple[str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    swapped: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = field(default_factory=list)
    in_place: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    home: dict[int, tuple[nn.Parameter, nn.Parameter]] = field(default_factory=dict)
    hooks: list[Any] = field(default_factory=list)
    shown: int = 0  # depth of originals_in_model blocks (nested ones change nothing)

    def sync_low(self, masters: list[tuple[str, nn.Parameter, nn.Parameter]] | None = None) -> None:
        """Low-precision params := cast(master) for ``masters`` (default: all), after an optimizer step."""
        masters = self.masters if masters is None else masters
        if masters:
            lows = [low.data for _, low, _ in masters]
            torch._foreach_copy_(lows, [m.data for _, _, m in masters])

    def add_masters(self, optimized: set[int], named: dict[str, nn.Parameter]) -> None:
        """The fp32 originals in ``optimized`` (ids) become masters of their low-precision copies (an optimizer
        wrapped after ``apply``); ``named``: the model's ``named_parameters()``."""
        have = {id(m) for _, _, m in self.masters}
        name_of = {id(p): n for n, p in named.items()}
        for low, original in self.home.values():
            if id(original) in optimized and id(original) not in have:
                self.masters.append((name_of.get(id(low), "?"), low, original))
                have.add(id(original))

    def restore(self) -> None:
        """Put the user's parameters back: originals (with the masters' values), exact dtypes.

        An in-place cast parameter gets its original tensor back when its value did not change
        (bit-exact undo), else its current value cast back.
        """
        for handle in self.hooks:
            handle.remove()
        for module, name, original, _ in reversed(self.swapped):
            module._parameters[name] = original
        for p, original in reversed(self.in_place):
            p.data = original if torch.equal(p.data, original.to(p.dtype)) else p.data.to(original.dtype)
        self.hooks.clear()
        self.swapped.clear()
        self.in_place.clear()
        self.masters.clear()
        self.home.clear()

    def link(self) -> None:
        """Hook every module holding a low-precision copy: its state dict is the fp32 original."""
        for module in {id(m): m for m, *_ in self.swapped}.values():
            for hooks in (module._state_dict_hooks, module._load_state_dict_pre_hooks):
                for key, hook in list(hooks.items()):  # inert hooks a copy of the model brought along
                    if isinstance(getattr(hook, "hook", hook), _Hook) and getattr(hook, "hook", hook).state is None:
                        del hooks[key]
            self.hooks.append(module.register_state_dict_post_hook(_Hook(self, load=False)))
            self.hooks.append(module.register_load_state_dict_pre_hook(_Hook(self, load=True)))

    def __deepcopy__(self, memo: dict[int, Any]) -> ParamState:
        """A copy over the copied parameters (part of copying the whole Amp), hooked to them."""
        new = ParamState(masters=copy.deepcopy(self.masters, memo), swapped=copy.deepcopy(self.swapped, memo),
                         in_place=copy.deepcopy(self.in_place, memo))
        memo[id(self)] = new
        new.home = {id(low): (low, original) for low, original in
                    (copy.deepcopy(pair, memo) for pair in self.home.values())}
        new.link()
        return new

    @contextmanager
    def originals_in_model(self) -> Iterator[None]:
        """The fp32 originals in the model's parameter slots for the block; then the low copies
        again, recast from the originals (which the block may have changed). Nested blocks change nothing."""
        if self.shown:
            yield
            return
        self.shown = 1
        for module, name, original, _ in self.swapped:
            module._parameters[name] = original
        try:
            yield
        finally:
            self.shown = 0
            for module, name, _, low in self.swapped:
                module._parameters[name] = low
            with torch.no_grad():
                for low, original in self.home.values():
                    low.copy_(original)


class MasterGrad(torch.Tensor):
    """A low-precision parameter's ``.grad`` after ``amp.unscale_()``: its fp32 master's unscaled gradient, shown with
    the parameter's dtype; every op on it runs on the master's gradient, so GradScaler's idiom
    ``clip_grad_norm_(model.parameters(), c)`` clips the gradients the optimizer steps.

    >>> p = nn.Parameter(torch.ones(2, dtype=torch.float16)); master_grad = torch.tensor([3.0, 4.0])
    >>> p.grad = MasterGrad(master_grad, p.dtype)
    >>> float(torch.nn.utils.clip_grad_norm_([p], 1.0)), [round(g, 4) for g in master_grad.tolist()]
    (5.0, [0.6, 0.8])
    """

    master: torch.Tensor

    @staticmethod
    def __new__(cls, master_grad: torch.Tensor, dtype: torch.dtype) -> MasterGrad:
        t = torch.Tensor._make_wrapper_subclass(cls, master_grad.shape, strides=master_grad.stride(), dtype=dtype,
                                                device=master_grad.device, requires_grad=False)
        t.master = master_grad
        return t

    def __repr__(self) -> str:
        return f"MasterGrad({self.master!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def unwrap(x: Any) -> Any:
            return x.master if isinstance(x, MasterGrad) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func._schema.is_mutable and args and isinstance(args[0], MasterGrad) and isinstance(out, torch.Tensor):
            return args[0]  # in place: the master's gradient changed, the wrapper stands for it
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:  # copies and pickles hold the plain fp32 gradient
        return self.master.__reduce_ex__(protocol)


class _Hook:
    """A module's state-dict hook that stands the fp32 originals in for their low copies.

    Holds the :class:`ParamState` weakly and matches parameters by identity, so a copy of the
    model (``copy.deepcopy``, pickle) saves and loads its own parameters, untouched.
    """

    def __init__(self, state: ParamState | None, load: bool) -> None:
        self.state = weakref.ref(state) if state is not None else None
        self.load = load

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Hook, (None, self.load))

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                 local_metadata: dict[str, Any], *_: Any) -> None:
        state = self.state() if self.state is not None else None
        if state is None:
            return
        for name, p in module._parameters.items():
            low, original = state.home.get(id(p), (None, None))
            key = prefix + name
            if low is not p or key not in state_dict:
                continue
            value = state_dict[key]
            if not self.load:
                state_dict[key] = original if value is p else original.detach()
                continue
            if local_metadata.get("assign_to_params_buffers", False):
                raise UnsupportedError(
                    f"load_state_dict(assign=True): '{key}' is a low-precision copy whose fp32 master the "
                    f"optimizer steps; assigning would cut it off. Load without assign=True, or load before "
                    f"unimp.apply (or after amp.remove())")
            if isinstance(value, torch.Tensor) and value.shape == original.shape:  # else torch refuses it
                with torch.no_grad():
                    original.copy_(value)


def cast_params(model: nn.Module, plan: Plan, optimized: set[int]) -> ParamState:
    """Give every parameter the Plan's param dtype; masters for those in ``optimized`` (ids)."""
    state = ParamState()
    try:
        _cast(model, plan, optimized, state)
        state.link()
    except BaseException:  # half-way: the slots, dtypes and hooks changed so far are put back
        state.restore()
        raise
    return state


def _cast(model: nn.Module, plan: Plan, optimized: set[int], state: ParamState) -> None:
    masters = plan.uses_master_weights
    done: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules():
        decision = plan.decide(path, kind(module), type_names(module))
        dtype = DTYPES[decision.param_dtype]
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == torch.float64:
                continue
            if id(p) in done:  # a tied weight: same object as before
                module._parameters[name] = done[id(p)]
                state.swapped.append((module, name, p, done[id(p)]))
                continue
            if p.dtype == dtype:
                continue
            qualified = f"{path}.{name}" if path else name
            if masters:  # a master when optimized; frozen: no master, the original kept for restore
                new = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = new
                done[id(p)] = new
                state.swapped.append((module, name, p, new))
                state.home[id(new)] = (new, p)
                if id(p) in optimized:
                    state.masters.append((qualified, new, p))
            else:
                state.in_place.append((p, p.data))
                p.data = p.data.to(dtype)
