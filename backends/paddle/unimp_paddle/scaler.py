"""Loss scaling for the dygraph path: the scale as a float32 Paddle tensor, and the rule.

Deciding whether to call a Paddle optimizer's ``step()`` needs the found-inf flag on the host (as Paddle's own
``GradScaler.step`` does), so the step syncs once anyway; after that the core's rule (:class:`unimp.loss_scale.
LossScale`) runs on Python numbers and the scale tensor is rewritten only when the scale changes: no tensor op
per step, every knob honoured (``scale_dtype = "float64"``: the canonical scale is a Python float, the tensor
that multiplies the loss its float32 rounding), and reading ``amp.scale`` / ``state_dict()`` needs no sync.
"""

from __future__ import annotations

from typing import Any

from unimp.spi import LossScale, LossScaleSpec, LossScaleState, dtypes


class DeviceLossScale:
    """The scale tensor (multiplies the loss, unscales the grads) + the core's rule on the host.

    >>> import unimp
    >>> s = DeviceLossScale(unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale)
    >>> s.update(True), float(s.scale.numpy()[0]), s.update(False), s.state().skipped
    (False, 16.0, True, 1)
    """

    def __init__(self, spec: LossScaleSpec, place: Any = None) -> None:
        self.spec = spec
        self.place = place
        self._rule = LossScale(spec)
        self.load(self._rule.initial_state())

    def load(self, st: LossScaleState) -> None:
        self._state = st
        self._write(st.scale)

    def state(self) -> LossScaleState:
        """The canonical state (plain numbers; no device sync)."""
        return self._state

    def update(self, finite: bool) -> bool:
        """Advance one step; returns True when the step is skipped."""
        out = self._rule.update(self._state, finite)
        if out.state.scale != self._state.scale:
            self._write(out.state.scale)
        self._state = out.state
        return out.skipped

    def _write(self, value: float) -> None:
        import paddle

        self.scale = paddle.to_tensor([dtypes.f32(value)], dtype="float32", place=self.place)
