"""The loss-scaling reference: one pure-Python state machine, every system's rule a knob away.

The rule itself is :func:`unimp.loss_scale.rule.step`, written once; :mod:`~unimp.loss_scale.reference`
runs it on Python numbers (the oracle every backend's scaler must reproduce exactly: scale sequence and
skip decisions), :mod:`~unimp.loss_scale.state` owns the canonical state and the checks of a saved one,
:mod:`~unimp.loss_scale.fallbacks` the knobs a backend cannot honour. The scale is held in
``loss_scale.scale_dtype`` (float32 like a framework's device tensor, or float64 like DeepSpeed's and
apex's Python float).

>>> import unimp
>>> rule = LossScale(unimp.load({"loss_scale": {"growth_interval": 2, "initial": 8.0}}).loss_scale)
>>> [o.scale for o in rule.replay([True, True, False, True])]
[8.0, 16.0, 8.0, 8.0]
"""

from unimp.dtypes import f32
from unimp.loss_scale.fallbacks import loss_scale_as_run, loss_scale_fallbacks
from unimp.loss_scale.reference import (
    LossScale,
    LossScaleAtMinimumError,
    Outcome,
    max_growth_tracker,
    policy_problems,
    trajectory,
)
from unimp.loss_scale.state import STATE_KEYS, LossScaleState, check_state

__all__ = ["STATE_KEYS", "LossScale", "LossScaleAtMinimumError", "LossScaleState", "Outcome", "check_state", "f32",
           "loss_scale_as_run", "loss_scale_fallbacks", "max_growth_tracker", "policy_problems", "trajectory"]
