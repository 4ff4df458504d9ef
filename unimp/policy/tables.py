"""The tables of a policy file as frozen dataclasses: op lists, loss scale, master weights, layout,
distributed, FP8 and the per-module overrides (:class:`unimp.policy.resolved.Policy` holds one of each).

>>> OpLists(lower=("linear",), float32=("softmax",), promote=()).category("softmax")
'float32'
>>> Override(modules=("head.*",)).matches("head.fc", ())
True
"""

from __future__ import annotations

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
    """The knobs of the loss-scale reference (see :mod:`unimp.loss_scale`)."""

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
