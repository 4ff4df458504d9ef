"""Loss scaling for the dygraph path: the scale as a float32 Paddle tensor, and the rule.

:class:`HostRuleLossScale` is what ``amp.optimizer.step()`` uses. Deciding whether to call a
Paddle optimizer's ``step()`` needs the found-inf flag on the host (Paddle's own dygraph
``GradScaler.step`` does ``if self._found_inf:``, and dygraph Adam ignores ``found_inf``), so the
step syncs once anyway; after that sync the core's reference rule (:class:`unimp.loss_scale.
LossScale`, plain Python, ~5 us) advances the canonical state and the scale tensor is rewritten only
when the scale changes. No tensor op per step, exact for every knob by construction, and reading
``amp.scale`` / ``state_dict()`` needs no device sync.

:class:`TensorLossScale` is the same rule in Paddle tensor ops with no host sync (scale in float32,
counters in int64, products formed in float64 and rounded once), for loops that keep the skip
decision on the device (a fused optimizer taking ``skip_update``, static graphs, CUDA graphs).

>>> import unimp, paddle
>>> spec = unimp.load({"loss_scale": {"growth_interval": 2, "initial": 8.0}}).loss_scale
>>> s = TensorLossScale(spec)
>>> for finite in (True, True, False):
...     _ = s.update(paddle.to_tensor([not finite]))
>>> s.state().scale
8.0
"""

from __future__ import annotations

from typing import Any

from unimp.spi import LossScale, LossScaleAtMinimumError, LossScaleSpec, LossScaleState


class HostRuleLossScale:
    """The scale tensor (multiplies the loss, unscales the grads) + the core's rule on the host.

    >>> import unimp
    >>> s = HostRuleLossScale(unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale)
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

        self.scale = paddle.to_tensor([value], dtype="float32", place=self.place)


class TensorLossScale:
    """Loss-scale state machine over Paddle tensors (``update(found_inf)`` per optimizer step)."""

    def __init__(self, spec: LossScaleSpec, place: Any = None) -> None:
        self.spec = spec
        self.place = place
        self.load(LossScale(spec).initial_state())

    # ------------------------------------------------------------------ state
    def load(self, st: LossScaleState) -> None:
        import paddle

        def t(value: Any, dtype: str) -> Any:
            return paddle.to_tensor([value], dtype=dtype, place=self.place)

        self.scale = t(st.scale, "float32")
        self.tracker = t(st.growth_tracker, "int64")
        self.hyst = t(st.hysteresis_left, "int64")
        self.skipped = t(st.skipped, "int64")
        self.steps = t(st.steps, "int64")

    def state(self) -> LossScaleState:
        """The canonical state as plain numbers (syncs with the device)."""
        return LossScaleState(scale=float(self.scale.numpy()[0]), growth_tracker=int(self.tracker.numpy()[0]),
                              hysteresis_left=int(self.hyst.numpy()[0]),
                              skipped=int(self.skipped.numpy()[0]), steps=int(self.steps.numpy()[0]))

    # ------------------------------------------------------------------ rule
    def update(self, found_inf: Any) -> Any:
        """Advance one step; ``found_inf`` is a bool tensor [1]. Returns the bool tensor 'skip'."""
        import paddle

        s = self.spec
        inf = found_inf.astype("bool").reshape([1])
        skip = paddle.logical_and(inf, paddle.to_tensor([s.skip_nonfinite], place=self.place))
        if s.mode == "dynamic":
            if s.at_min == "error":
                self._check_floor(inf)
            f_scale, f_tracker, f_hyst = self._finite()
            n_scale, n_tracker, n_hyst = self._nonfinite()
            self.scale = paddle.where(inf, n_scale, f_scale)
            self.tracker = paddle.where(inf, n_tracker, f_tracker)
            self.hyst = paddle.where(inf, n_hyst, f_hyst)
        self.skipped = self.skipped + skip.astype("int64")
        self.steps = self.steps + 1
        return skip

    def _round(self, x64: Any) -> Any:
        return x64.astype("float32")

    def _finite(self) -> tuple[Any, Any, Any]:
        import paddle

        s, n = self.spec, self.spec.growth_interval
        hyst = paddle.full_like(self.hyst, s.hysteresis) if "finite" in s.hysteresis_refill else self.hyst
        zero = paddle.zeros_like(self.tracker)
        if s.growth_schedule == "interval":
            bumped = self.tracker + 1
            grow = bumped >= n
            tracker = paddle.where(grow, zero, bumped)
        elif s.growth_schedule == "interval_plus_one":
            grow = self.tracker >= n
            tracker = paddle.where(grow, zero, self.tracker + 1)
        else:  # window
            grow = paddle.logical_and(self.tracker > 0, paddle.remainder(self.tracker, paddle.full_like(
                self.tracker, n)) == 0)
            tracker = self.tracker + 1
        scale = paddle.where(grow, self._grown(), self.scale)
        if "growth" in s.hysteresis_refill:
            hyst = paddle.where(grow, paddle.full_like(self.hyst, s.hysteresis), hyst)
        return scale, tracker, hyst

    def _grown(self) -> Any:
        import paddle

        s = self.spec
        new = self._round(self.scale.astype("float64") * s.growth_factor)
        new64 = new.astype("float64")
        keep_old = paddle.zeros_like(self.scale, dtype="bool")
        if s.growth_requires_finite:
            keep_old = paddle.logical_not(paddle.isfinite(new))
        above = new64 > s.max
        if s.on_max == "clamp":
            capped = paddle.where(above, paddle.full_like(self.scale, s.max), new)
        else:
            capped = paddle.where(above, self.scale, new)
        return paddle.where(keep_old, self.scale, capped)

    def _nonfinite(self) -> tuple[Any, Any, Any]:
        import paddle

        s = self.spec
        absorb = self.hyst > 1
        backed = self._round(self.scale.astype("float64") * s.backoff_factor)
        floor = paddle.full_like(self.scale, s.min)
        backed = paddle.maximum(backed, floor)
        refill = paddle.full_like(self.hyst, s.hysteresis) if "backoff" in s.hysteresis_refill else self.hyst
        return (paddle.where(absorb, self.scale, backed), paddle.zeros_like(self.tracker),
                paddle.where(absorb, self.hyst - 1, refill))

    def _check_floor(self, inf: Any) -> None:
        import paddle

        s = self.spec
        at_floor = paddle.logical_and(paddle.logical_and(inf, self.hyst <= 1),
                                      self.scale.astype("float64") <= s.min)
        if bool(at_floor.numpy()[0]):
            raise LossScaleAtMinimumError(
                f"loss scale already at its minimum ({s.min:g}) and gradients are still not finite; "
                f"set loss_scale.at_min = 'clamp' to keep training at the floor")
