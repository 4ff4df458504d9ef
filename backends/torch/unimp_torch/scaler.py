"""Loss scaling on the device: the core reference rule as tensor ops, no host round trip.

State lives in tensors on the model's device (``scale`` float32, tracker and hysteresis int32,
skipped int64); only ``steps`` is a host counter. When the policy's knobs are exactly torch
GradScaler's rule (no floor, no cap, hysteresis 1), the update is torch's own fused kernel
``torch._amp_update_scale_``; otherwise the same rule in ``torch.where`` form, with products
taken in float64 and rounded to float32 exactly as :mod:`unimp.loss_scale` does.

>>> import torch, unimp
>>> s = DeviceLossScale(unimp.load({"loss_scale": {"initial": 8.0, "growth_interval": 1}}).loss_scale, "cpu")
>>> s.update(torch.zeros(())); s.state().scale
16.0
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from unimp.spi import LossScale, LossScaleAtMinimumError, LossScaleSpec, LossScaleState, StateError, f32


def torch_rule(spec: LossScaleSpec) -> bool:
    """Whether ``spec`` is exactly torch GradScaler's rule (so its fused kernel can run it)."""
    return (spec.mode == "dynamic" and spec.growth_schedule == "interval" and spec.hysteresis == 1
            and spec.min == 0.0 and math.isinf(spec.max) and spec.growth_requires_finite)


class DeviceLossScale:
    """The loss-scale state machine of ``spec`` on ``device``."""

    def __init__(self, spec: LossScaleSpec, device: str | torch.device) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.native = torch_rule(spec)
        self.checks = spec.mode != "none" or spec.skip_nonfinite  # finiteness is needed at all
        self.losses = 0  # losses scaled so far: new gradients may have arrived since this changed
        self.set_state(LossScale(spec).initial_state())

    # ------------------------------------------------------------------ state
    def set_state(self, st: LossScaleState) -> None:
        """Replace the state: every tensor is built first, so a value that does not fit changes nothing."""
        tensors = []
        for key, value, dtype in (("scale", st.scale, torch.float32),
                                  ("growth_tracker", st.growth_tracker, torch.int32),
                                  ("hysteresis_left", st.hysteresis_left, torch.int32),
                                  ("skipped", st.skipped, torch.int64)):
            try:
                tensors.append(torch.full((), f32(value) if key == "scale" else value, dtype=dtype, device=self.device))
            except (TypeError, ValueError, OverflowError, RuntimeError) as e:
                raise StateError(f"loss-scale state: {key} = {str(value)[:40]} does not fit the device's "
                                 f"{str(dtype)[6:]} counter ({e}); load a state_dict saved by unimp") from None
        self.scale, self.tracker, self.hysteresis, self.skipped = tensors
        self.steps = st.steps
        self._inv = None

    def state(self) -> LossScaleState:
        """The canonical state (reads the device: one sync on CUDA)."""
        return LossScaleState(scale=float(self.scale.item()), growth_tracker=int(self.tracker.item()),
                              hysteresis_left=int(self.hysteresis.item()), skipped=int(self.skipped.item()),
                              steps=self.steps)

    # ------------------------------------------------------------------ per step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self.losses += 1
        if self.spec.mode == "none":
            return loss
        return loss.float() * self.scale

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
        self.steps += 1
        if found_inf is None:
            return
        if s.skip_nonfinite:
            self.skipped += (found_inf > 0).to(torch.int64)
        if s.mode != "dynamic":
            return
        if self.native:
            torch._amp_update_scale_(self.scale, self.tracker, found_inf, s.growth_factor,
                                     s.backoff_factor, s.growth_interval)
            return
        self._update_where(found_inf > 0)

    def _update_where(self, bad: torch.Tensor) -> None:
        s = self.spec
        scale, tracker, hyst = self.scale, self.tracker, self.hysteresis
        n = s.growth_interval
        # finite step
        if s.growth_schedule == "interval":
            grow = tracker + 1 >= n
            tracker_ok = torch.where(grow, 0, tracker + 1)
        elif s.growth_schedule == "interval_plus_one":
            grow = tracker >= n
            tracker_ok = torch.where(grow, 0, tracker + 1)
        else:  # window
            grow = (tracker > 0) & (tracker % n == 0)
            tracker_ok = tracker + 1
        new = (scale.double() * s.growth_factor).float()
        cap = f32(s.max) if s.on_max == "clamp" else scale
        grown = torch.where(new.double() > s.max, cap, new)
        if s.growth_requires_finite:
            grown = torch.where(torch.isfinite(new), grown, scale)
        scale_ok = torch.where(grow, grown, scale)
        hyst_ok = torch.full_like(hyst, s.hysteresis) if "finite" in s.hysteresis_refill else hyst
        if "growth" in s.hysteresis_refill:
            hyst_ok = torch.where(grow, s.hysteresis, hyst_ok)
        # non-finite step
        absorb = hyst > 1
        backed = (scale.double() * s.backoff_factor).float().clamp_min(f32(s.min))  # no host->device copy
        if s.at_min == "error" and bool((bad & ~absorb & (scale <= s.min)).item()):  # host read: this knob
            raise LossScaleAtMinimumError(
                f"loss scale already at its minimum ({s.min:g}) and gradients are still not finite; "
                f"set loss_scale.at_min = 'clamp' to keep training at the floor")
        scale_bad = torch.where(absorb, scale, backed)
        refill = s.hysteresis if "backoff" in s.hysteresis_refill else hyst
        hyst_bad = torch.where(absorb, hyst - 1, refill)
        self.scale.copy_(torch.where(bad, scale_bad, scale_ok))
        self.tracker.copy_(torch.where(bad, 0, tracker_ok))
        self.hysteresis.copy_(torch.where(bad, hyst_bad, hyst_ok))
