"""Bad input is a clear error naming the argument (or state-dict key) and the fix.

>>> import torch
>>> check_inputs(torch.nn.Linear(2, 2), None, None)
'cpu'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from unimp.spi import StateError, UnsupportedError


def device_of(model: Any) -> str:
    """The device type of the model's parameters (``cpu`` when it has none or no model is given)."""
    if model is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kinds = {t.device.type for t in (*model.parameters(), *model.buffers())}
    if len(kinds) > 1:
        raise UnsupportedError(f"model: parameters are on several device types {sorted(kinds)}; unimp-torch "
                               f"needs one (model.to('cuda') or model.to('cpu') before unimp.apply)")
    return kinds.pop() if kinds else "cpu"


def first_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (``cpu`` when it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def check_inputs(model: Any, optimizer: Any, on_skip: Any) -> str:
    """Validate ``model``/``optimizer``/``on_skip``; returns the model's device type."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}; pass the module "
                        f"itself (not its state_dict or a function)")
    check_modules(model)
    device = device_of(model)
    check_optimizers(model, as_list(optimizer), "optimizer")
    if on_skip is not None and not callable(on_skip):
        raise TypeError(f"on_skip: expected a callable taking no arguments, got {type(on_skip).__name__}")
    return device


def as_list(optimizer: Any) -> list[Any]:
    """``unimp.apply``'s optimizer argument as a list: ``None`` -> ``[]``, one -> ``[it]``, a list/tuple: its items."""
    if optimizer is None:
        return []
    return list(optimizer) if isinstance(optimizer, list | tuple) else [optimizer]


def check_optimizers(model: torch.nn.Module, optimizers: list[Any], where: str,
                     taken: dict[int, str] | None = None, own: set[int] | None = None) -> None:
    """Each is a ``torch.optim.Optimizer`` over ``own`` ids (default ``model.parameters()``), no
    parameter in two of them nor in ``taken`` (id -> its optimizer); errors name the optimizer, group, index."""
    own = {id(p) for p in model.parameters()} if own is None else own
    seen = dict(taken or {})
    several = len(optimizers) > 1
    for oi, optimizer in enumerate(optimizers):
        name = f"{where}[{oi}]" if several else where
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{name}: expected a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                            f"build one over model.parameters(), pass a list of them, or None")
        for gi, group in enumerate(optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in own:
                    raise ValueError(
                        f"{name}: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is not a "
                        f"parameter of this model; build the optimizer from this model's parameters, e.g. "
                        f"torch.optim.AdamW(model.parameters()), after moving the model to its device")
                if id(p) in seen and seen[id(p)] != name:
                    raise ValueError(
                        f"{name}: param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) is also stepped "
                        f"by {seen[id(p)]}; each parameter belongs to one optimizer (its gradient is unscaled "
                        f"once per step); split the parameters between the optimizers")
                seen[id(p)] = name


def check_modules(model: torch.nn.Module) -> None:
    """Refuse, before anything changes, TorchScript modules and uninitialised lazy parameters (nothing
    to hook or cast); the error names the module path and the fix."""
    from torch.nn.parameter import is_lazy

    for path, m in model.named_modules():
        where = f"'{path}'" if path else "the model itself"
        if isinstance(m, torch.jit.ScriptModule):
            raise UnsupportedError(
                f"model: {where} is a TorchScript module ({type(m).__name__}); unimp binds a policy to an eager "
                f"nn.Module (TorchScript fixes its forward and refuses hooks). Apply the policy to the module "
                f"before torch.jit.script, or use torch.compile(amp.model) instead of TorchScript")
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and is_lazy(t):
                qualified = f"{path}.{name}" if path else name
                raise UnsupportedError(
                    f"model: '{qualified}' ({type(m).__name__}) is an uninitialised lazy "
                    f"{'parameter' if name in m._parameters else 'buffer'}; run one forward with an example "
                    f"batch (model(x)) before building the optimizer and calling unimp.apply, so that lazy "
                    f"modules create their weights")


# per-parameter optimizer state that has the parameter's shape (torch.optim's built-in optimizers)
PARAM_SHAPED = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum",
                          "square_avg", "acc_delta", "grad_avg", "prev", "step_size", "ax"})
_FIX = "load the state_dict saved from this optimizer (same parameters, same order) under this policy"


def check_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: Any, names: dict[int, str]) -> None:
    """Refuse an optimizer ``state_dict`` that would load garbage: one :class:`StateError` naming the
    keys, before anything is loaded. ``names`` maps ``id(param)`` to its model name.

    >>> m = torch.nn.Linear(2, 2)
    >>> check_optimizer_state(torch.optim.SGD(m.parameters(), lr=0.1), {"state": {}}, {})
    Traceback (most recent call last):
    ...
    unimp.errors.StateError: amp.optimizer.load_state_dict: 'param_groups' missing: load the state_dict ...
    """
    problems = _optimizer_problems(optimizer, state_dict, names)
    if problems:
        shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
        head = "amp.optimizer.load_state_dict: "
        raise StateError(head + shown[0] + f": {_FIX}" if len(shown) == 1 else
                         head + f"{len(problems)} problems, nothing loaded ({_FIX}):\n  " + "\n  ".join(shown))


def _optimizer_problems(optimizer: torch.optim.Optimizer, sd: Any, names: dict[int, str]) -> list[str]:
    if not isinstance(sd, Mapping):
        return [f"expected a dict with 'state' and 'param_groups', got {type(sd).__name__}"]
    groups = optimizer.param_groups
    saved_groups: Any = sd.get("param_groups")  # each checked below
    state: Any = sd.get("state")
    for key, value, kinds in (("param_groups", saved_groups, (list, tuple)), ("state", state, Mapping)):
        if value is None:
            return [f"'{key}' missing"]
        if not isinstance(value, kinds):
            return [f"'{key}': expected a {'list' if key == 'param_groups' else 'dict'}, got {type(value).__name__}"]
    if len(saved_groups) != len(groups):
        return [f"'param_groups': {len(saved_groups)} groups, this optimizer has {len(groups)}"]
    problems: list[str] = []
    by_id: dict[Any, tuple[str, torch.Tensor]] = {}
    for gi, (group, saved) in enumerate(zip(groups, saved_groups, strict=True)):
        where = f"param_groups[{gi}]"
        if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list | tuple):
            problems.append(f"{where}: expected a dict with a 'params' list")
            continue
        if len(saved["params"]) != len(group["params"]):
            problems.append(f"{where}['params']: {len(saved['params'])} parameters, this optimizer's group "
                            f"has {len(group['params'])}")
            continue
        for pid, p in zip(saved["params"], group["params"], strict=True):
            if not isinstance(pid, int) or isinstance(pid, bool) or pid in by_id:
                problems.append(f"{where}['params']: {_short(pid)} is not a parameter index, or repeats one")
                continue
            by_id[pid] = (names.get(id(p), f"{where} parameter"), p)
        for key, value in group.items():
            if key != "params" and key in saved:
                bad = _kind_problem(value, saved[key], key)
                if bad:
                    problems.append(f"{where}[{_short(key)}]: {bad}")
    if problems:
        return problems
    for pid, entry in state.items():
        if pid not in by_id:
            problems.append(f"state[{_short(pid)}]: no parameter with this index in 'param_groups'")
            continue
        name, p = by_id[pid]
        if not isinstance(entry, Mapping):
            problems.append(f"state[{_short(pid)}] ({name}): expected a dict, got {type(entry).__name__}")
            continue
        current = optimizer.state.get(p) or {}
        for key, value in entry.items():
            bad = _state_problem(key, value, p, current.get(key))
            if bad:
                problems.append(f"state[{_short(pid)}][{_short(key)}] ({name}): {bad}")
    return problems


def _number(v: Any) -> float | None:
    if isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
        return float(v.item())
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    return None


def _finite_number(v: Any) -> bool:
    x = _number(v)
    return x is not None and math.isfinite(x)


def _kind_problem(current: Any, saved: Any, key: str) -> str | None:
    """A saved hyperparameter that cannot stand where this optimizer has ``current``."""
    if isinstance(current, bool):
        return None if isinstance(saved, bool) else f"expected true/false, got {_short(saved)}"
    if _number(current) is not None:
        x = _number(saved)
        if x is None or not math.isfinite(x) or (key == "lr" and x < 0):
            return f"expected a finite number{' >= 0' if key == 'lr' else ''}, got {_short(saved)}"
        return None
    numbers = isinstance(current, list | tuple) and all(_number(c) is not None for c in current)
    if numbers and (not isinstance(saved, list | tuple) or len(saved) != len(current)
                    or not all(_finite_number(s) for s in saved)):
        return f"expected {len(current)} finite numbers, got {_short(saved)}"
    return None


def _short(v: Any) -> str:
    """A bounded description of ``v`` (never the repr of a large container)."""
    if isinstance(v, str):
        return repr(v[:40]) + ("..." if len(v) > 40 else "")
    if isinstance(v, int | float | bool | None):
        return repr(v)[:40]
    if isinstance(v, list | tuple) and len(v) <= 4 and all(isinstance(x, int | float | bool | None) for x in v):
        return repr(v)[:60]
    return type(v).__name__


def _state_problem(key: Any, value: Any, p: torch.Tensor, current: Any) -> str | None:
    if key == "step":
        x = _number(value)
        if x is None or not math.isfinite(x) or x < 0 or x != int(x):
            return f"expected a whole number of steps >= 0, got {_short(value)}"
        return None
    if not isinstance(value, torch.Tensor):
        if key in PARAM_SHAPED and value is not None:
            return f"expected a tensor of shape {tuple(p.shape)}, got {type(value).__name__}"
        return None
    shape = p.shape if key in PARAM_SHAPED else current.shape if isinstance(current, torch.Tensor) else None
    if shape is not None and value.shape != shape:
        return f"shape {tuple(value.shape)}, the parameter's state has shape {tuple(shape)}"
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        return "holds NaN or infinite values"
    return None
