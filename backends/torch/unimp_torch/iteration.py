"""The torch side of :mod:`unimp.loss_scale.iteration`: the flags are device ``found_inf`` tensors,
summed into one (GradScaler's ``found_inf_combined``) for :class:`DeviceLossScale.update`.

>>> import torch, unimp
>>> from unimp.spi import Plan
>>> from unimp_torch.scaler import DeviceLossScale
>>> spec = Plan.request(unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}), "torch").loss_scale
>>> it = Iteration(DeviceLossScale(spec, "cpu")); it.join("a", "SGD"); it.join("b", "SGD")
>>> it.stepped("a", torch.zeros(())); it.scaler.state().scale  # b has not stepped yet
8.0
>>> it.stepped("b", torch.zeros(())); it.scaler.state().scale
16.0
"""

from __future__ import annotations

import torch

from unimp.spi import Iteration as SharedScale

from .scaler import DeviceLossScale


class Iteration(SharedScale):
    """The optimizers sharing ``scaler``."""

    def __init__(self, scaler: DeviceLossScale) -> None:
        super().__init__()
        self.scaler = scaler

    def advance(self, flags: list[torch.Tensor]) -> None:
        combined = None
        for f in flags:  # summed, as GradScaler.update's found_inf_combined
            combined = f if combined is None else combined + f
        self.scaler.update(combined)  # None: nothing checked (no scaling, no skipping): the step counted
