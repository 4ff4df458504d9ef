"""Paddle optimizers that step an applied model's parameters around unimp, refused at their first step.

A dygraph optimizer unimp does not wrap, stepping parameters of a layer under a policy that scales the loss,
would apply the *scaled* gradient; under O2 with master weights its update of the low-precision parameters is
overwritten by the wrapped optimizer's masters. Both are refused with an :class:`unimp.errors.UnsupportedError`
naming the fix, before anything changes; so is the optimizer passed to ``unimp.apply`` stepped around its
wrapper. Where nothing is scaled and there are no masters any optimizer is let through
(:mod:`unimp.loss_scale.strays` decides, as for torch).

Paddle has no global optimizer step hook: while some Amp is applied, the update funnel of every dygraph
``step()``, ``minimize()`` and ``apply_gradients()``, ``paddle.optimizer.Optimizer._create_optimization_pass``,
is wrapped by :func:`_guarded` (a dictionary lookup per step); the last ``remove()`` puts Paddle's own back.
``LBFGS`` steps its parameters itself and is not seen.

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

from typing import Any

from unimp.spi import UnsupportedError, strays

_original: list[Any] = []  # Optimizer's own _create_optimization_pass, kept at the first install


def _install() -> None:
    import paddle

    if not _original:
        _original.append(paddle.optimizer.Optimizer.__dict__["_create_optimization_pass"])
    paddle.optimizer.Optimizer._create_optimization_pass = _guarded


def _uninstall() -> None:
    import paddle

    paddle.optimizer.Optimizer._create_optimization_pass = _original[0]


_guard = strays.Guard(_install, _uninstall)  # live PaddleAmps, their wrappers' inner optimizers, checked ones


def params_of(optimizer: Any) -> list[Any]:
    """The parameters ``optimizer`` steps (its ``_param_groups``: parameters, or dicts of them)."""
    groups = getattr(optimizer, "_param_groups", None) or getattr(optimizer, "_parameter_list", None) or []
    return [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]


def watch(amp: Any) -> None:
    """Guard ``amp``'s layer from unwrapped optimizers (the funnel wrapped while any Amp is applied); each of
    ``amp.optimizers`` (AmpOptimizers) wraps its ``inner``: the inner one's steps come from it."""
    for opt in amp.optimizers:
        _guard.wrap(opt.inner, opt, amp)
    _guard.watch(amp)


def unwatch(amp: Any) -> None:
    """``amp`` was removed: its layer and optimizers are plain again; the last one puts the funnel back."""
    _guard.unwatch(amp, [(opt.inner, opt) for opt in getattr(amp, "optimizers", [])])


def _guarded(self: Any, parameters_and_grads: Any, param_group_idx: int = 0) -> Any:
    """``Optimizer._create_optimization_pass``, after the check of :func:`check` (dygraph only)."""
    check(self)
    return _original[0](self, parameters_and_grads, param_group_idx)


def check(optimizer: Any) -> None:
    """Refuse ``optimizer``'s update when it steps an applied layer's parameters around unimp."""
    if _guard.owner(optimizer) is not None:  # passed to unimp.apply: refused only when stepped around its wrapper
        owner = _guard.stepped_around(optimizer)
        if owner is not None and strays.at_risk(owner.scaled, owner.masters):
            raise strays.direct(f"{type(optimizer).__name__}.step()", owner.scaled)
        return
    import paddle

    if paddle.in_dynamic_mode():  # else a static Program being built: unimp_paddle.static's own path
        _guard.check(optimizer, lambda amp: _problem(amp, optimizer))


def _problem(amp: Any, optimizer: Any) -> UnsupportedError | None:
    scaled = amp.scaler.spec.mode != "none"
    if not strays.at_risk(scaled, amp.masters):  # nothing goes wrong
        return None
    names = {id(p): n for n, p in amp._layer.named_parameters()}
    hit = next((names[id(p)] for p in params_of(optimizer) if id(p) in names), None)
    if hit is None:
        return None
    return strays.unwrapped(f"{type(optimizer).__name__}.step()", hit, type(amp._layer).__name__, amp.plan.name,
                            scaled, amp.scale if scaled else None)
