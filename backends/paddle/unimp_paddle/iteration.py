"""The Paddle side of :mod:`unimp.loss_scale.iteration`: the flags are "all finite" booleans (read once per
optimizer step), the update is :class:`DeviceLossScale.update` once every optimizer sharing the scale stepped.
"""

from __future__ import annotations

from unimp.spi import Iteration

from .scaler import DeviceLossScale


class PaddleIteration(Iteration):
    """The optimizers sharing one :class:`DeviceLossScale`; their flags are "all finite" booleans."""

    def __init__(self, scaler: DeviceLossScale) -> None:
        super().__init__()
        self.scaler = scaler

    def advance(self, flags: list[bool]) -> None:
        self.scaler.update(all(flags))
