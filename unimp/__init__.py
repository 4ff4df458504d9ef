"""unimp: one mixed-precision policy, written once, the same in every framework.

>>> import unimp
>>> policy = unimp.load("mixed_bf16")
>>> policy.compute_dtype
'bfloat16'

``unimp.apply(policy, model, optimizer)`` binds it to a model of any installed backend
(unimp-torch, unimp-jax, unimp-keras, unimp-paddle, unimp-ipex). Importing unimp imports
no framework.
"""

from unimp.backend import Amp, Backend, UnimpWarning
from unimp.backend.registry import apply, backends, detect, get_backend, register_backend, scope
from unimp.errors import AlreadyAppliedError, PolicyError, StateError, UnsupportedError
from unimp.loss_scale import LossScale, LossScaleState, trajectory
from unimp.plan import OpDecision, Plan, compile_ops
from unimp.policy import Override, Policy
from unimp.policy.loading import dump, dumps, load, preset_names
from unimp.policy.ops import CANONICAL_OPS, OPS
from unimp.report import Report, ReportRow
from unimp.tuning import sensitivity, tune
from unimp.watch import Watch, read_records

__version__ = "0.1.0"

__all__ = [
    "CANONICAL_OPS", "OPS", "AlreadyAppliedError", "Amp", "Backend", "LossScale", "LossScaleState", "OpDecision",
    "Override", "Plan", "Policy", "PolicyError", "Report", "ReportRow", "StateError", "UnimpWarning",
    "UnsupportedError", "Watch", "apply", "backends", "compile_ops", "detect", "dump", "dumps", "get_backend",
    "load", "preset_names", "read_records", "register_backend", "scope", "sensitivity", "trajectory", "tune",
]
