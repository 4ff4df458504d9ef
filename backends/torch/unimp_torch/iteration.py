"""One loss-scale update per training iteration, over every optimizer sharing the scale.

``torch.amp.GradScaler`` with several optimizers (torch's AMP examples, "Working with Multiple
Models, Losses, and Optimizers"): ``scaler.step(opt_a); scaler.step(opt_b); scaler.update()``.
Each optimizer is unscaled and checked on its own parameters and skipped only when *its own*
gradients are not finite; ``update()`` then advances the scale once, from the flags of every
optimizer stepped since the last update (their sum, as GradScaler's ``found_inf_combined``).

Here the update runs by itself once every optimizer of the group has stepped (or skipped) since
the last one: with one optimizer, after each step as before. A loop where some optimizer does not
step every iteration (a critic stepped five times per generator step) ends the iteration with
``amp.update()``; stepping an optimizer a second time before the update is refused, as
GradScaler refuses ``step()`` twice since the last ``update()``.

>>> import torch
>>> from unimp.spi import Plan
>>> import unimp
>>> from unimp_torch.scaler import DeviceLossScale
>>> spec = Plan.request(unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}), "torch").loss_scale
>>> it = Iteration(DeviceLossScale(spec, "cpu")); a, b = object(), object(); it.join(a); it.join(b)
>>> it.stepped(a, torch.zeros(())); it.scaler.state().scale  # b has not stepped yet
8.0
>>> it.stepped(b, torch.zeros(())); it.scaler.state().scale
16.0
"""

from __future__ import annotations

from typing import Any

import torch

from unimp.spi import UnsupportedError

from .scaler import DeviceLossScale


class Iteration:
    """The optimizers sharing one :class:`DeviceLossScale` and the flags of those stepped since its last update."""

    def __init__(self, scaler: DeviceLossScale) -> None:
        self.scaler = scaler
        self.members: list[Any] = []  # the AmpOptimizers, in the order they joined
        self.found: dict[Any, torch.Tensor | None] = {}  # member -> its found_inf (None: not checked)

    def join(self, optimizer: Any) -> None:
        self.members.append(optimizer)

    def leave(self, optimizer: Any) -> None:
        """``optimizer`` no longer shares the scale (its Amp was removed); a flag it left still counts."""
        self.members = [m for m in self.members if m is not optimizer]
        if self.found and len(self.found) >= len(self.members):
            self.update()

    def check_step(self, optimizer: Any, verb: str) -> None:
        """Refuse a second step of ``optimizer`` before the update (nothing changed yet)."""
        if optimizer not in self.found:
            return
        waiting = [type(m.optimizer).__name__ for m in self.members if m not in self.found]
        raise UnsupportedError(
            f"{verb}: this optimizer already stepped since the last loss-scale update, which waits for the other "
            f"optimizers sharing the scale (not stepped yet: {', '.join(waiting)}); when not every optimizer "
            f"steps every iteration, call amp.update() after the last optimizer step of each iteration "
            f"(torch.amp.GradScaler's scaler.update())")

    def stepped(self, optimizer: Any, found: torch.Tensor | None) -> None:
        """``optimizer`` stepped (or skipped) with ``found``; the update runs once every member has."""
        self.found[optimizer] = found
        if len(self.found) >= len(self.members):
            self.update()

    @property
    def pending(self) -> list[int]:
        """Indices of the members that stepped since the last update while others have not (empty between
        iterations)."""
        return [i for i, m in enumerate(self.members) if m in self.found]

    def update(self) -> None:
        """The scale advanced once from the flags of the optimizers stepped since the last update (none: nothing)."""
        if not self.found:
            return
        flags = [f for f in self.found.values() if f is not None]
        self.found.clear()
        combined = None
        for f in flags:  # summed, as GradScaler.update's found_inf_combined
            combined = f if combined is None else combined + f
        self.scaler.update(combined)

    def reset(self) -> None:
        """A loaded loss-scale state replaces the iteration's flags."""
        self.found.clear()
