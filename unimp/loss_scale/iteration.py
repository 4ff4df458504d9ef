"""One loss-scale update per training iteration, over every optimizer sharing the scale.

``torch.amp.GradScaler`` with several optimizers (torch's AMP examples, "Working with Multiple
Models, Losses, and Optimizers"): ``scaler.step(opt_a); scaler.step(opt_b); scaler.update()``.
Each optimizer is unscaled and checked on its own parameters and skipped only when *its own*
gradients are not finite; ``update()`` then advances the scale once, from the flags of every
optimizer stepped since the last update (any non-finite: a backoff, as GradScaler's summed
``found_inf_combined``).

Here the update runs by itself once every optimizer of the group has stepped (or skipped) since
the last one: with one optimizer, after each step. A loop where some optimizer does not step every
iteration (a critic stepped five times per generator step) ends the iteration with
``amp.update()``; stepping an optimizer a second time before the update is refused, as GradScaler
refuses ``step()`` twice since the last ``update()``. A backend subclasses :class:`Iteration` with
:meth:`Iteration.advance` (its flags into its scaler); the bookkeeping is written once, here.

Whatever ends a training iteration for the run (a numerics watch records one per iteration, whichever
optimizer steps first) listens to the update: :meth:`Iteration.listen` adds a callable that
:meth:`Iteration.notify` calls once per update with its flags (member -> flag, None: not checked). The
backend calls :meth:`notify` once the verb that made the update returned (the last optimizer's ``step()``,
``amp.update()``), not from inside the optimizer step, where a listener's failure would leave that step
half done.

>>> class Printed(Iteration):
...     def advance(self, flags): print("update from", flags)
>>> it = Printed(); it.join("opt_d", "Adam"); it.join("opt_g", "Adam")
>>> it.stepped("opt_d", True)  # opt_g has not stepped yet: no update
>>> it.stepped("opt_g", False)
update from [True, False]
>>> it.listen(lambda flags: print("iteration ended:", flags))
>>> it.stepped("opt_d", False); it.stepped("opt_g", False); it.notify()
update from [False, False]
iteration ended: {'opt_d': False, 'opt_g': False}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unimp.errors import UnsupportedError


class Iteration:
    """The optimizers sharing one loss scale, and the flags of those stepped since its last update."""

    def __init__(self) -> None:
        self.members: list[Any] = []  # the backend's optimizer wrappers, in the order they joined
        self.names: dict[Any, str] = {}  # member -> what messages call it (its optimizer's class)
        self.found: dict[Any, Any] = {}  # member -> its flag (None: not checked)
        self.listeners: list[Callable[[dict[Any, Any]], None] | None] = []  # None: a copy's (not listened to)
        self._ended: list[dict[Any, Any]] = []  # the flags of updates the listeners were not told of yet

    def advance(self, flags: list[Any]) -> None:
        """Advance the scale once from ``flags`` (each stepped member's, None left out; may be empty)."""
        raise NotImplementedError

    def join(self, member: Any, name: str) -> None:
        self.members.append(member)
        self.names[member] = name

    def leave(self, member: Any) -> None:
        """``member`` no longer shares the scale (its Amp was removed); a flag it left still counts."""
        self.members = [m for m in self.members if m is not member]
        self.names.pop(member, None)
        if self.found and len(self.found) >= len(self.members):
            self.update()

    def check_step(self, member: Any, verb: str) -> None:
        """Refuse a second step of ``member`` before the update (nothing changed yet)."""
        if member not in self.found:
            return
        waiting = [self.names[m] for m in self.members if m not in self.found]
        raise UnsupportedError(
            f"{verb}: this optimizer already stepped since the last loss-scale update, which waits for the other "
            f"optimizers sharing the scale (not stepped yet: {', '.join(waiting)}); when not every optimizer "
            f"steps every iteration, call amp.update() after the last optimizer step of each iteration "
            f"(torch.amp.GradScaler's scaler.update())")

    def stepped(self, member: Any, flag: Any) -> None:
        """``member`` stepped (or skipped) with ``flag``; the update runs once every member has."""
        self.found[member] = flag
        if len(self.found) >= len(self.members):
            self.update()

    @property
    def pending(self) -> list[int]:
        """Indices of the members that stepped since the last update while others have not (empty between
        iterations)."""
        return [i for i, m in enumerate(self.members) if m in self.found]

    def update(self) -> None:
        """The scale advanced once from the flags of the members stepped since the last update (none: nothing)."""
        if not self.found:
            return
        found = dict(self.found)
        self.found.clear()
        self.advance([f for f in found.values() if f is not None])
        if any(self.listeners):
            self._ended.append(found)

    def listen(self, listener: Callable[[dict[Any, Any]], None]) -> None:
        """Call ``listener(found)`` once per update, from :meth:`notify` (``found``: each member stepped since the
        last update -> its flag, None where it was not checked)."""
        self.listeners.append(listener)

    def unlisten(self, listener: Callable[[dict[Any, Any]], None]) -> None:
        self.listeners = [f for f in self.listeners if f is not listener]

    def notify(self) -> None:
        """Tell the listeners of the updates since the last call, in order (an update is told once: a listener
        that raises is not called for it again)."""
        while self._ended:
            found = self._ended.pop(0)
            for listener in list(self.listeners):
                if listener is not None:
                    listener(found)

    def reset(self) -> None:
        """A loaded loss-scale state replaces the iteration's flags."""
        self.found.clear()

    def refuse_pending(self, verb: str) -> None:
        """Refuse ``verb`` (saving the state) mid-iteration: the update the flags wait for is not in the state."""
        if self.pending:
            raise UnsupportedError(
                f"{verb}: {len(self.pending)} of the {len(self.members)} optimizers sharing the loss scale stepped "
                f"since its last update and the others have not; save after every optimizer of the iteration "
                f"stepped (or after amp.update())")

    # ------------------------------------------------------------------ a watch's steps are iterations
    def refuse_watch(self) -> None:
        """Refuse ``amp.watch()`` mid-iteration (call it before anything is installed: the watch's first record
        would miss what ran before; :mod:`unimp.watch.iteration`)."""
        from unimp.watch.iteration import refuse_mid_iteration

        refuse_mid_iteration(self)

    def watch(self, watch: Any) -> None:
        """``watch.step_end(found)`` at the end of each iteration (:mod:`unimp.watch.iteration`)."""
        from unimp.watch.iteration import listen

        listen(self, watch)

    def unwatch(self, watch: Any) -> None:
        """``watch`` no longer ends steps (``watch.close()``)."""
        from unimp.watch.iteration import unlisten

        unlisten(self, watch)
