"""Loss scaling on the device: the core reference rule as tensor ops, no host round trip.

State lives in tensors on the model's device (only ``steps`` is a host counter). With exactly GradScaler's knobs
the update is torch's fused ``torch._amp_update_scale_``; otherwise the core's rule
(:func:`unimp.loss_scale.rule.step`) runs on the tensors through :class:`TorchOps`.

>>> import torch, unimp
>>> from unimp.spi import Plan
>>> spec = Plan.request(unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}), "torch").loss_scale
>>> s = DeviceLossScale(spec, "cpu")
>>> s.update(torch.zeros(())); s.state().scale
16.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from unimp.spi import (
    Arrays,
    LossScale,
    LossScaleAtMinimumError,
    LossScaleSpec,
    LossScaleState,
    StateError,
    dtypes,
    step,
)

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def torch_rule(spec: LossScaleSpec) -> bool:
    """Whether ``spec`` is exactly torch GradScaler's rule (so its fused kernel can run it)."""
    return (spec.mode == "dynamic" and spec.growth_schedule == "interval" and spec.hysteresis == 1
            and spec.min == 0.0 and math.isinf(spec.max) and spec.growth_requires_finite
            and spec.scale_dtype == "float32" and spec.factor_arithmetic == "float64" and spec.subnormal == "keep"
            and spec.backoff == "multiply")


class DeviceLossScale:
    """The loss-scale state machine of ``spec`` on ``device``."""

    def __init__(self, spec: LossScaleSpec, device: str | torch.device) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.native = False
        self._ops = TorchOps(spec, self.device)
        self.checks = spec.mode != "none" or spec.skip_nonfinite  # finiteness is needed at all
        self.losses = 0  # losses scaled so far: new gradients may have arrived since this changed
        self.set_state(LossScale(spec).initial_state())

    def set_state(self, st: LossScaleState) -> None:
        """Replace the state: every tensor is built first, so a value that does not fit changes nothing."""
        tensors = []
        for key, value, dtype in (("scale", st.scale, _DTYPES[self.spec.scale_dtype]),
                                  ("growth_tracker", st.growth_tracker, torch.int32),
                                  ("hysteresis_left", st.hysteresis_left, torch.int32),
                                  ("skipped", st.skipped, torch.int64)):
            try:
                value = LossScale(self.spec).held(value) if key == "scale" else value
                tensors.append(torch.full((), value, dtype=dtype, device=self.device))
            except (TypeError, ValueError, OverflowError, RuntimeError) as e:
                raise StateError(f"loss-scale state: {key} = {str(value)[:40]} does not fit the device's "
                                 f"{str(dtype)[6:]} counter ({e}); load a state_dict saved by unimp") from None
        self.scale, self.tracker, self.hysteresis, self.skipped = tensors
        self.steps = st.steps
        # torch's kernel grows at tracker + 1 == interval: the rule's >= only from a tracker below the interval
        self.native = torch_rule(self.spec) and st.growth_tracker < self.spec.growth_interval
        self._inv = None

    def state(self) -> LossScaleState:
        """The canonical state (reads the device: one sync on CUDA)."""
        return LossScaleState(scale=float(self.scale.item()), growth_tracker=int(self.tracker.item()),
                              hysteresis_left=int(self.hysteresis.item()), skipped=int(self.skipped.item()),
                              steps=self.steps)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.losses += 1
        if self.spec.mode == "none":
            return loss
        return loss.float() * self.scale.float()  # a float64 scale past FLT_MAX gives inf, as DeepSpeed's

    def unscale_(self, grads: Iterable[torch.Tensor]) -> torch.Tensor:
        """Divide ``grads`` by the scale in place; returns found_inf (float32 0/1 on the device)."""
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        inv = (self.scale.double().reciprocal().float() if self.spec.mode != "none"
               else torch.ones((), dtype=torch.float32, device=self.device))
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), gs in groups.items():
            if dev == self.device:
                torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
            else:  # grads on another device: check there, fold into ours
                f = torch.zeros((), dtype=torch.float32, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(gs, f, inv.to(dev))
                found += f.to(self.device)
        return found

    def update(self, found_inf: torch.Tensor | None) -> None:
        """Advance the rule by one optimizer step (``found_inf`` None: the step was not checked)."""
        s = self.spec
        self.steps = min(self.steps + 1, dtypes.INT32_MAX)  # the rule's counters saturate (unimp.loss_scale.rule.step)
        if found_inf is None:
            return
        if s.skip_nonfinite:
            self.skipped += ((found_inf > 0) & (self.skipped < dtypes.INT32_MAX)).to(torch.int64)
        if s.mode != "dynamic":
            return
        if self.native:
            torch._amp_update_scale_(self.scale, self.tracker, found_inf, s.growth_factor,
                                     s.backoff_factor, s.growth_interval)
            return
        self._update_where(found_inf > 0)

    def _update_where(self, bad: torch.Tensor) -> None:
        """The core's rule (:func:`unimp.loss_scale.rule.step`) on the device tensors, written back in place."""
        s = self.spec
        st = Arrays(self.scale, self.tracker, self.hysteresis, self.skipped, 0)
        new, _, error = step(self._ops, s, st, ~bad)
        if error is not None and bool(error.item()):  # host read: only with at_min = "error"
            raise LossScaleAtMinimumError(
                f"loss scale already at its minimum ({s.min:g}) and gradients are still not finite; "
                f"set loss_scale.at_min = 'clamp' to keep training at the floor")
        self.scale.copy_(new.scale)
        self.tracker.copy_(new.growth_tracker)
        self.hysteresis.copy_(new.hysteresis_left)


class TorchOps:
    """:class:`unimp.loss_scale.rule.ArrayOps` over torch tensors on one device (constants cached: no
    host->device copy per step)."""

    def __init__(self, spec: LossScaleSpec, device: torch.device) -> None:
        self.dtype = _DTYPES[spec.scale_dtype]
        self.device = device
        self._consts: dict[tuple, torch.Tensor] = {}

    def _const(self, value: float, dtype: torch.dtype) -> torch.Tensor:
        key = (value, dtype)
        if key not in self._consts:
            self._consts[key] = torch.full((), value, dtype=dtype, device=self.device)
        return self._consts[key]

    def scalar(self, value: float) -> torch.Tensor:
        return self._const(value, self.dtype)

    def counter(self, value: int) -> torch.Tensor:
        return self._const(value, torch.int32)

    def count(self, flag: torch.Tensor) -> torch.Tensor:
        return flag.to(torch.int64)

    def mul(self, scale: torch.Tensor, factor: float) -> torch.Tensor:
        return (scale.double() * factor).to(self.dtype)  # one rounding, subnormals kept (IEEE)

    def div(self, scale: torch.Tensor, divisor: float) -> torch.Tensor:
        return (scale.double() / divisor).to(self.dtype)  # float64 quotient of float32 values: one rounding

    where, isfinite = staticmethod(torch.where), staticmethod(torch.isfinite)
    logical_and, logical_not = staticmethod(torch.logical_and), staticmethod(torch.logical_not)
    maximum = staticmethod(torch.maximum)
