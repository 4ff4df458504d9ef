"""Keras optimizers that step an applied model's variables around unimp, refused at their first step.

A plain Keras optimizer (or the one passed to ``unimp.apply``, stepped itself) would apply scaled gradients, skip
no step, or have its update overwritten by the fp32 masters: refused with an :class:`unimp.errors.UnsupportedError`
naming the fix, as :mod:`unimp.loss_scale.strays` decides (under ``mixed_bf16`` any optimizer is let through).
While some Amp is applied, Keras' ``BaseOptimizer.apply`` and ``stateless_apply`` are wrapped (the last
``remove()`` puts them back); an optimizer is checked at its first step, again after an ``apply`` or ``remove``.

>>> import keras, numpy as np, unimp
>>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="fc")], name="net")
>>> amp = unimp.apply("mixed_fp16", m, keras.optimizers.SGD(0.1))
>>> stray = keras.optimizers.SGD(0.1)
>>> stray.apply([np.ones((2, 2), "float32"), np.ones(2, "float32")], m.trainable_variables)  # doctest: +ELLIPSIS
Traceback (most recent call last):
unimp.errors.UnsupportedError: SGD.apply(): this optimizer steps 'net/fc/kernel' of a Sequential under the unimp ...
>>> _ = amp.remove()
"""

from __future__ import annotations

from typing import Any

from keras.src.optimizers.base_optimizer import BaseOptimizer

from unimp.spi import UnsupportedError, strays

_original = {name: BaseOptimizer.__dict__[name] for name in ("apply", "stateless_apply")}  # Keras' own
#: Keras keeps one optimizer per model (each its own loss scale, as Keras' mixed_float16 does)
FIX = ("apply the policy to the (sub-)model this optimizer trains, with it: amp_d = unimp.apply(policy, "
       "discriminator, d_optimizer), and step amp_d.optimizer (its scale_loss, then apply_gradients) in train_step; "
       "one Amp per sub-model, each optimizer its own loss scale")


def _install() -> None:
    BaseOptimizer.apply, BaseOptimizer.stateless_apply = _apply, _stateless_apply


def _uninstall() -> None:
    BaseOptimizer.apply, BaseOptimizer.stateless_apply = _original["apply"], _original["stateless_apply"]


_guard = strays.Guard(_install, _uninstall)  # live KerasAmps, their wrappers' inner optimizers, checked ones


def watch(amp: Any) -> None:
    """Guard ``amp``'s model from unwrapped optimizers (Keras' apply wrapped while any Amp is applied)."""
    if amp.optimizer is not None:
        _guard.wrap(amp.optimizer.inner_optimizer, amp.optimizer, amp)
    _guard.watch(amp)


def unwatch(amp: Any) -> None:
    """``amp`` was removed: its model and optimizer are plain again; the last one puts Keras' functions back."""
    _guard.unwatch(amp, [(amp.optimizer.inner_optimizer, amp.optimizer)] if amp.optimizer is not None else [])


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    """``BaseOptimizer.apply`` after :func:`check`."""
    check(self, "apply()", trainable_variables)
    return _original["apply"](self, grads, trainable_variables)


def _stateless_apply(self: Any, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
    """``BaseOptimizer.stateless_apply`` after :func:`check` (its variables: the ones it was built over)."""
    check(self, "stateless_apply()", None)
    return _original["stateless_apply"](self, optimizer_variables, grads, trainable_variables)


def check(optimizer: Any, verb: str, variables: Any) -> None:
    """Refuse ``optimizer``'s step when it steps an applied model's variables around unimp."""
    if _guard.owner(optimizer) is not None:  # passed to unimp.apply: refused only when stepped around its wrapper
        owner = _guard.stepped_around(optimizer)
        scaled = owner is not None and owner.spec.mode != "none"
        if owner is not None and strays.at_risk(scaled, bool(getattr(owner, "_masters", None))):
            raise strays.direct(f"{type(optimizer).__name__}.{verb}", scaled)
        return
    if variables is None:
        variables = optimizer._trainable_variables if optimizer.built else []
    # a built optimizer's variables are fixed: checked once per apply/remove
    _guard.check(optimizer, lambda amp: _problem(amp, f"{type(optimizer).__name__}.{verb}", list(variables)),
                 cache=optimizer.built)


def _problem(amp: Any, verb: str, variables: list) -> UnsupportedError | None:
    scaled = amp.plan.loss_scale.mode != "none"
    masters = dict(getattr(amp.optimizer, "_masters", None) or {})
    if not strays.at_risk(scaled, bool(masters)):
        return None
    names = {id(v): getattr(v, "path", v.name) for v in amp.model.trainable_variables}
    names |= {id(m): names[i] + " (its fp32 master)" for i, m in masters.items() if i in names}
    hit = next((names[id(v)] for v in variables if id(v) in names), None)
    if hit is None:
        return None
    return strays.unwrapped(verb, hit, type(amp.model).__name__, amp.plan.name, scaled, _scale(amp) if scaled else None,
                            fix=FIX, scaling="amp.scale_loss(loss)", plain="gradients of the unscaled loss")


def _scale(amp: Any) -> float | None:
    """The current loss scale, where it can be read (not while a ``tf.function`` or ``jit`` traces)."""
    try:
        return amp.scale
    except Exception:
        return None
