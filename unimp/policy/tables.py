"""The tables of a policy file as frozen dataclasses: op lists, loss scale, master weights, layout,
distributed, FP8 and the per-module overrides (:class:`unimp.policy.resolved.Policy` holds one of each).

>>> OpLists(lower=("linear",), float32=("softmax",), promote=()).category("softmax")
'float32'
>>> Override(modules=("head.*",)).matches("head.fc", ())
True
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class OpLists:
    """Which canonical ops run low, in float32, promoted; the rest follow their inputs."""

    lower: tuple[str, ...]
    float32: tuple[str, ...]
    promote: tuple[str, ...]

    def category(self, op: str) -> str:
        """``lower`` | ``float32`` | ``promote`` | ``inputs`` (in no list)."""
        for name in ("lower", "float32", "promote"):
            if op in getattr(self, name):
                return name
        return "inputs"


@dataclass(frozen=True)
class LossScaleSpec:
    """The knobs of the loss-scale reference (see :mod:`unimp.loss_scale`).

    ``initial_auto``: the policy says ``initial = "auto"`` (the default), so the scale starts where the
    framework's own scaler does; ``initial`` then holds 2^16, torch's, Flax's and Paddle's, until a backend
    whose framework starts elsewhere resolves it (:meth:`starting_at`; Keras: 2^15).

    >>> import unimp
    >>> spec = unimp.load("mixed_fp16").loss_scale
    >>> spec.initial, spec.initial_auto, spec.starting_at(32768.0).initial
    (65536.0, True, 32768.0)
    >>> unimp.load({"loss_scale": {"initial": 1024.0}}).loss_scale.starting_at(32768.0).initial
    1024.0
    """

    mode: str
    initial: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min: float
    max: float
    skip_nonfinite: bool
    growth_schedule: str
    on_max: str
    growth_requires_finite: bool
    hysteresis_refill: tuple[str, ...]
    at_min: str
    scale_dtype: str = "float32"
    subnormal: str = "keep"
    factor_arithmetic: str = "float64"
    backoff: str = "multiply"
    initial_auto: bool = False

    def starting_at(self, framework_initial: float, who: str = "this backend") -> LossScaleSpec:
        """This spec with an ``auto`` initial scale resolved to ``framework_initial`` (where ``who``'s own
        scaler starts); an explicit ``initial`` is kept. A resolved scale outside ``[min, max]`` is a
        :class:`unimp.PolicyError` naming the knob."""
        if not self.initial_auto:
            return self
        from unimp.errors import PolicyError

        for knob, bad in (("min", self.min > framework_initial), ("max", self.max < framework_initial)):
            if bad:
                raise PolicyError(f"loss_scale.{knob} ({getattr(self, knob):g}) leaves out the scale "
                                  f"initial = \"auto\" starts at on {who} ({framework_initial:g}); fix: set "
                                  f"loss_scale.initial to a value inside [min, max]")
        return dataclasses.replace(self, initial=framework_initial, initial_auto=False)


@dataclass(frozen=True)
class MasterWeights:
    enabled: bool
    dtype: str


@dataclass(frozen=True)
class Layout:
    channels_last: bool
    align: int
    on_misaligned: str


@dataclass(frozen=True)
class Distributed:
    reduce_dtype: str


@dataclass(frozen=True)
class Fp8Spec:
    """The ``[fp8]`` table: which canonical ops run FP8 and how they are scaled (see :mod:`unimp.plan.fp8`)."""

    enabled: bool = False
    ops: tuple[str, ...] = ("linear",)
    recipe: str = "tensorwise"
    amax_history: int = 16
    forward_format: str = "e4m3"
    gradient_format: str = "e5m2"
    dims_multiple: int = 16


@dataclass(frozen=True)
class Override:
    """Per-module dtypes; matches a module whose path fits a glob OR whose type is listed."""

    modules: tuple[str, ...] = ()
    types: tuple[str, ...] = ()
    compute_dtype: str | None = None
    param_dtype: str | None = None
    fp8: bool | None = None

    @property
    def sets_dtype(self) -> bool:
        """Whether it changes dtypes (an override that only sets ``fp8`` leaves them to the rest)."""
        return self.compute_dtype is not None or self.param_dtype is not None

    def matches(self, path: str, type_names: Iterable[str]) -> bool:
        if any(fnmatch.fnmatchcase(path, g) for g in self.modules):
            return True
        return bool(set(self.types) & set(type_names))
