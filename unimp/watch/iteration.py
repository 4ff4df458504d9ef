"""A watch's step is a training iteration: the update of the loss scale its Amp's optimizers share
(:class:`unimp.loss_scale.iteration.Iteration`), whichever optimizer steps first. A backend's watch listens
to that update with :func:`listen` (its ``step_end(found)`` called once per update, from
:meth:`~unimp.loss_scale.iteration.Iteration.notify`, with each stepped optimizer's flag) and stops with
:func:`unlisten`; a watch started mid-iteration is refused first, before anything is installed
(:func:`refuse_mid_iteration`: its first record would miss what ran before).

>>> from unimp.loss_scale.iteration import Iteration
>>> class Printed(Iteration):
...     def advance(self, flags): pass
>>> class Device:
...     def step_end(self, found): print("iteration ended:", found)
>>> it, device = Printed(), Device()
>>> it.join("opt_d", "Adam"); it.join("opt_g", "Adam")
>>> refuse_mid_iteration(it); listen(it, device)
>>> it.stepped("opt_d", True); it.stepped("opt_g", False); it.notify()
iteration ended: {'opt_d': True, 'opt_g': False}
>>> it.stepped("opt_d", True)
>>> try:
...     refuse_mid_iteration(it)
... except Exception as e:
...     print(type(e).__name__)
UnsupportedError
>>> unlisten(it, device); it.stepped("opt_g", True); it.notify()  # nothing printed
"""

from __future__ import annotations

from typing import Any

from unimp.errors import UnsupportedError


class StepEnd:
    """The listener: calls ``watch.step_end(found)``. A copy or a pickle of the Amp holding it is not watched
    (it becomes None, which :meth:`~unimp.loss_scale.iteration.Iteration.notify` skips)."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch

    def __call__(self, found: dict[Any, Any]) -> None:
        self.watch.step_end(found)

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_none, ())


def _none() -> None:
    return None


def refuse_mid_iteration(iteration: Any) -> None:
    """Refuse ``amp.watch()`` while some optimizers sharing the scale stepped since its last update."""
    if iteration.pending:
        raise UnsupportedError(f"amp.watch(): {len(iteration.pending)} of the {len(iteration.members)} optimizers "
                               f"sharing the loss scale stepped since its last update (mid-iteration); start the "
                               f"watch between iterations: after the iteration's last optimizer step, or after "
                               f"amp.update()")


def listen(iteration: Any, watch: Any) -> None:
    """``watch.step_end(found)`` at the end of each iteration of ``iteration``."""
    iteration.listen(StepEnd(watch))


def unlisten(iteration: Any, watch: Any) -> None:
    """``watch`` no longer ends steps (``watch.close()``)."""
    for listener in list(iteration.listeners):
        if isinstance(listener, StepEnd) and listener.watch is watch:
            iteration.unlisten(listener)
