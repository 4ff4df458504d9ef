"""Paddle optimizers that step an applied model's parameters around unimp, refused at their first step.

A dygraph ``paddle.optimizer`` optimizer unimp does not wrap, stepping parameters of a layer under a
policy that scales the loss, would apply the *scaled* gradient; under O2 with master weights
(``fp16_master`` on a GPU) its update of the low-precision parameters is overwritten by the wrapped
optimizer's masters. Both are refused with an :class:`unimp.errors.UnsupportedError` naming the fix,
before anything changes; so is the optimizer passed to ``unimp.apply`` stepped around its wrapper. Where
nothing is scaled and there are no masters (``mixed_bf16``) any optimizer is let through
(:mod:`unimp.loss_scale.strays` decides, as for torch).

Paddle has no global optimizer step hook: while some Amp is applied, the base class's update funnel
``paddle.optimizer.Optimizer._create_optimization_pass`` (what ``step()``, every subclass's ``step()``,
``minimize()`` and ``apply_gradients()`` run in dygraph, before any parameter or accumulator changes) is
wrapped by :func:`_guarded`, which costs a dictionary lookup per step: an optimizer is checked against the
applied layers at its first step, again only after an ``apply`` or ``remove``. The last ``remove()`` puts
Paddle's own function back (so does the first step after the last Amp was dropped and collected). No
finalizer of unimp's runs here; a lock is held only to swap the function, never across user code. ``LBFGS`` steps its parameters itself and is not seen.

>>> import paddle, unimp
>>> m = paddle.nn.Linear(2, 2)
>>> amp = unimp.apply({"extends": "paddle_o1", "on_unsupported": "fallback"}, m)
>>> stray = paddle.optimizer.SGD(0.1, parameters=m.parameters())
>>> amp.backward(m(paddle.randn([3, 2])).sum())
>>> stray.step()  # doctest: +ELLIPSIS
Traceback (most recent call last):
unimp.errors.UnsupportedError: SGD.step(): this optimizer steps 'weight' of a Linear under the unimp policy ...
>>> _ = amp.remove()
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from unimp.spi import UnsupportedError, strays

_amps: weakref.WeakSet[Any] = weakref.WeakSet()  # live PaddleAmps
# inner optimizer -> weakref to its AmpOptimizer (which holds the inner one: a strong value would keep both alive)
_wrapped: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()
_checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # -> generation
_state: dict[str, Any] = {"generation": 0, "installed": False}
_original: list[Any] = []  # Optimizer's own _create_optimization_pass, kept at the first install
_install = threading.Lock()  # held only to swap the funnel in or out (no user code, no finalizer under it)


def params_of(optimizer: Any) -> list[Any]:
    """The parameters ``optimizer`` steps (its ``_param_groups``: parameters, or dicts of them)."""
    groups = getattr(optimizer, "_param_groups", None) or getattr(optimizer, "_parameter_list", None) or []
    return [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]


def watch(amp: Any) -> None:
    """Guard ``amp``'s layer from unwrapped optimizers (the funnel wrapped while any Amp is applied)."""
    import paddle

    with _install:
        if not _original:
            _original.append(paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"])
        if not _state["installed"]:
            paddle.optimizer.Optimizer._create_optimization_pass = _guarded
            _state["installed"] = True
        _amps.add(amp)
        _state["generation"] += 1


def wrapped(optimizer: Any) -> None:
    """``optimizer`` (an AmpOptimizer) wraps ``optimizer.inner``: its inner steps come from it."""
    _wrapped[optimizer.inner] = weakref.ref(optimizer)


def unwatch(amp: Any) -> None:
    """``amp`` was removed: its layer and optimizers are plain again; the last one puts the funnel back."""
    for opt in getattr(amp, "optimizers", []):
        ref = _wrapped.get(opt.inner)
        if ref is not None and ref() is opt:
            del _wrapped[opt.inner]
    _amps.discard(amp)
    _state["generation"] += 1
    _uninstall_if_idle()


def _uninstall_if_idle() -> None:
    """No Amp left (removed, or dropped and collected): Paddle's own funnel back."""
    import paddle

    with _install:
        if not _amps and _state["installed"]:
            paddle.optimizer.Optimizer._create_optimization_pass = _original[0]
            _state["installed"] = False


def _guarded(self: Any, parameters_and_grads: Any, param_group_idx: int = 0) -> Any:
    """``Optimizer._create_optimization_pass``, after the check of :func:`check` (dygraph only)."""
    check(self)
    return _original[0](self, parameters_and_grads, param_group_idx)


def check(optimizer: Any) -> None:
    """Refuse ``optimizer``'s update when it steps an applied layer's parameters around unimp."""
    ref = _wrapped.get(optimizer)
    owner = ref() if ref is not None else None
    if owner is not None:
        if not owner.in_step and strays.at_risk(owner.scaled, owner.masters):
            raise strays.direct(f"{type(optimizer).__name__}.step()", owner.scaled)
        return
    generation = _state["generation"]
    if _checked.get(optimizer) == generation:
        return
    import paddle

    if not paddle.in_dynamic_mode():  # a static Program being built: unimp_paddle.static's own path
        return
    amps = list(_amps)
    for amp in amps:
        problem = _problem(amp, optimizer)
        if problem is not None:
            raise problem
    if not amps:  # the last Amp was dropped without remove() and collected
        _uninstall_if_idle()
    _checked[optimizer] = generation


def _problem(amp: Any, optimizer: Any) -> UnsupportedError | None:
    scaled = amp.scaler.spec.mode != "none"
    if amp._removed or not strays.at_risk(scaled, amp.masters):  # nothing goes wrong
        return None
    names = {id(p): n for n, p in amp._layer.named_parameters()}
    hit = next((names[id(p)] for p in params_of(optimizer) if id(p) in names), None)
    if hit is None:
        return None
    return strays.unwrapped(f"{type(optimizer).__name__}.step()", hit, type(amp._layer).__name__, amp.plan.name,
                            scaled, amp.scale if scaled else None)
