"""What a policy asks, resolved at a compute dtype: the pieces :class:`unimp.plan.PlanRequest` answers with.

The overrides are resolved here, once, for every backend (:func:`override_dtypes`: ``auto`` is the
compute dtype), as are the op dtypes (:func:`requested_dtype`) and the loss-scale spec asked
(:func:`asked_loss_scale`); a backend never walks the policy's override list.

>>> import unimp
>>> pol = unimp.load({"extends": "mixed_bf16", "overrides": [{"types": ["Linear"], "compute_dtype": "auto"},
...                                                          {"modules": ["head"], "param_dtype": "float32"}]})
>>> [(r.setting, r.dtype, r.follows_compute) for r in override_dtypes(pol, "float16")]
[('overrides[0].compute_dtype', 'float16', True), ('overrides[1].param_dtype', 'float32', False)]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from unimp.policy import LossScaleSpec, Policy


@dataclass(frozen=True)
class DtypeRequest:
    """One dtype an override asks, resolved: ``auto`` is the request's compute dtype (``follows_compute``)."""

    override: int  # its index in the policy's overrides
    key: str  # compute_dtype | param_dtype
    dtype: str
    follows_compute: bool = False  # the override says "auto"

    @property
    def setting(self) -> str:
        """How messages name it: ``overrides[2].compute_dtype``."""
        return f"overrides[{self.override}].{self.key}"


def requested_dtype(policy: Policy, op: str, compute_dtype: str) -> str | None:
    """The dtype the policy asks for ``op`` (None = follow inputs / promote)."""
    return {"lower": compute_dtype, "float32": "float32"}.get(policy.ops.category(op))


def asked_loss_scale(policy: Policy, compute_dtype: str) -> LossScaleSpec:
    """The loss-scale spec the policy asks at a resolved ``compute_dtype``: its own, except that ``auto``
    resolved to float16 turns a ``none`` mode into dynamic scaling (fp16 without scaling underflows)."""
    spec = policy.loss_scale
    if policy.compute_dtype == "auto" and compute_dtype == "float16" and spec.mode == "none":
        return dataclasses.replace(spec, mode="dynamic", skip_nonfinite=True)
    return spec


def override_dtypes(policy: Policy, compute_dtype: str) -> tuple[DtypeRequest, ...]:
    """Every dtype an override of ``policy`` asks, in override order (compute before param), ``auto``
    resolved to ``compute_dtype``."""
    out = []
    for i, o in enumerate(policy.overrides):
        for key in ("compute_dtype", "param_dtype"):
            value = getattr(o, key)
            if value is not None:
                auto = value == "auto"
                out.append(DtypeRequest(i, key, compute_dtype if auto else value, auto))
    return tuple(out)
