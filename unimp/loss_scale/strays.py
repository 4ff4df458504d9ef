"""Optimizers that step an applied model's parameters around unimp: when that goes wrong, and the refusal.

Written once for every backend that detects such a step (torch: a global ``torch.optim`` step pre-hook,
``unimp_torch.strays``; Paddle: the dygraph optimizers' update funnel, ``unimp_paddle.strays``; Keras:
``BaseOptimizer.apply`` / ``stateless_apply``, ``unimp_keras.strays``): the decision (:func:`at_risk`), the
refusals (:func:`unwrapped`, :func:`direct`) and the bookkeeping of what is guarded (:class:`Guard`). An
optimizer unimp does not wrap, stepping parameters of a model whose loss unimp scales, applies the
*scaled* gradient (the loss scale times the update, never skipped on overflow); where the policy keeps
fp32 master weights, its update of the low-precision copies is overwritten by the next wrapped step. Where
nothing is scaled and there are no masters (``mixed_bf16``), any optimizer steps the model as natively.

>>> at_risk(scaled=False, masters=False), at_risk(scaled=True, masters=False)
(False, True)
>>> print(unwrapped("SGD.step()", "layer.weight", "Linear", "mixed_fp16", True, 65536.0))  # doctest: +ELLIPSIS
SGD.step(): this optimizer steps 'layer.weight' of a Linear under the unimp policy 'mixed_fp16' but ...
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from unimp.errors import UnsupportedError


def at_risk(scaled: bool, masters: bool) -> bool:
    """Whether an optimizer unimp does not wrap steps a model wrongly: its loss is scaled or it has masters."""
    return scaled or masters


#: the fix where an Amp holds several optimizers (torch, Paddle)
ADD = ("pass it to unimp.apply(policy, model, [optimizer, ...]) with the others, or wrap it after apply with "
       "opt = amp.add_optimizer(opt) and step what that returns (after amp.backward(loss))")


def _consequence(scaled: bool, loss_scale: float | None, scaling: str, plain: str) -> str:
    if scaled:
        times = f"loss scale {loss_scale:g} times" if loss_scale is not None else "the loss scale times"
        return (f"after {scaling} its update would be the scaled gradient's ({times} too large), never skipped "
                f"on overflow; after {plain} the policy's loss scaling would not run at all")
    return ("its update would be lost: the model holds low-precision copies of fp32 master weights, "
            "and every wrapped step copies the masters over them")


def unwrapped(verb: str, param: str, model: str, policy: str, scaled: bool, loss_scale: float | None = None, *,
              fix: str = ADD, scaling: str = "amp.backward(loss)",
              plain: str = "a plain loss.backward()") -> UnsupportedError:
    """The refusal of an unwrapped optimizer's ``verb`` (``"SGD.step()"``) that would step ``param`` of a
    ``model`` (its class name) under ``policy``; ``scaled``: the loss is scaled (``loss_scale``: the current
    scale, where it can be read), else the harm is the masters. ``fix``, ``scaling`` (how the backend's user
    scales a loss) and ``plain`` (a backward without it) are in the backend's words."""
    return UnsupportedError(
        f"{verb}: this optimizer steps '{param}' of a {model} under the unimp policy '{policy}' but unimp "
        f"does not wrap it: {_consequence(scaled, loss_scale, scaling, plain)}. Fix: {fix}")


def direct(verb: str, scaled: bool) -> UnsupportedError:
    """The refusal of ``verb`` on an optimizer passed to ``unimp.apply``, stepped around its wrapper."""
    return UnsupportedError(
        f"{verb}: this optimizer was passed to unimp.apply, which wraps it; step the wrapper (amp.optimizer, "
        f"or amp.optimizers[i] with several): stepping it directly would apply "
        + ("the scaled gradients" if scaled else "updates the fp32 masters never get")
        + " without unimp's unscale, skip and master copy")


class Guard:
    """A backend's applied Amps, the optimizers they wrap and those already checked, all held weakly.

    ``install`` / ``uninstall`` put the backend's interception in place and take it out (torch: a global
    step hook kept for the process, no ``uninstall``; Paddle, Keras: a framework function wrapped only while
    some Amp is applied). :meth:`check` runs a backend's test over the live Amps once per optimizer and
    generation (a new ``apply`` or ``remove`` starts one): per step a dictionary lookup. An Amp counts while
    ``amp.applied()`` (not removed, nor rolled back with a failed ``unimp.apply``). A lock is held only
    to install or uninstall, never across user code, and no finalizer runs here.

    >>> class Amp:
    ...     def applied(self): return True
    >>> class Optimizer: pass
    >>> g, amp, opt = Guard(), Amp(), Optimizer()
    >>> g.watch(amp)
    >>> g.check(opt, lambda amp: None), g.checked[opt] == g.generation
    (None, True)
    """

    def __init__(self, install: Callable[[], None] | None = None, uninstall: Callable[[], None] | None = None) -> None:
        self.amps: weakref.WeakSet[Any] = weakref.WeakSet()
        # inner optimizer -> weak references to its wrapper (which holds the inner one) and Amp
        Refs = tuple[weakref.ref[Any], weakref.ref[Any]]
        self.wrapped: weakref.WeakKeyDictionary[Any, Refs] = weakref.WeakKeyDictionary()
        self.checked: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # -> generation
        self.generation = 0
        self._install, self._uninstall = install, uninstall
        self._installed = False
        self._lock = threading.Lock()  # held only to install or uninstall

    def watch(self, amp: Any) -> None:
        """Guard ``amp``'s model (the interception installed first where it is not)."""
        with self._lock:
            if not self._installed and self._install is not None:
                self._install()
                self._installed = True
        self.amps.add(amp)
        self.generation += 1

    def wrap(self, inner: Any, wrapper: Any, amp: Any) -> None:
        """``wrapper`` (``amp``'s) steps ``inner``: ``inner``'s steps come from it."""
        self.wrapped[inner] = (weakref.ref(wrapper), weakref.ref(amp))

    def owner(self, inner: Any) -> Any:
        """The wrapper of ``inner`` (per step: one dictionary lookup), or None."""
        refs = self.wrapped.get(inner)
        return refs[0]() if refs is not None else None

    def stepped_around(self, inner: Any) -> Any:
        """``inner``'s wrapper where ``inner`` steps outside it (``wrapper.in_step`` false) while its Amp is
        applied: the step to refuse; else None."""
        refs = self.wrapped.get(inner)
        wrapper, amp = (refs[0](), refs[1]()) if refs is not None else (None, None)
        if wrapper is None or amp is None or wrapper.in_step or not amp.applied():
            return None
        return wrapper

    def unwatch(self, amp: Any, wrappers: list[tuple[Any, Any]]) -> None:
        """``amp`` was removed: its ``(inner, wrapper)`` pairs are plain again; the last Amp uninstalls."""
        for inner, wrapper in wrappers:
            refs = self.wrapped.get(inner)
            if refs is not None and refs[0]() is wrapper:
                del self.wrapped[inner]
        self.amps.discard(amp)
        self.generation += 1
        self._uninstall_if_idle()

    def check(self, optimizer: Any, problem: Callable[[Any], UnsupportedError | None], cache: bool = True) -> None:
        """Raise ``problem(amp)`` for the first live Amp it is not None for (``optimizer`` not checked since the
        last apply/remove); ``cache``: remember that ``optimizer`` passed."""
        generation = self.generation
        if self.checked.get(optimizer) == generation:
            return
        amps = [amp for amp in list(self.amps) if amp.applied()]
        for amp in amps:
            found = problem(amp)
            if found is not None:
                raise found
        if not self.amps:  # the last Amp was dropped with its model, without remove(), and collected
            self._uninstall_if_idle()
        if cache:
            self.checked[optimizer] = generation

    def _uninstall_if_idle(self) -> None:
        with self._lock:
            if not self.amps and self._installed and self._uninstall is not None:
                self._uninstall()
                self._installed = False
