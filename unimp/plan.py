"""A policy compiled for one backend: per canonical op, what that backend will do and how.

Backends build a Plan with :func:`compile_ops` from what they can control; the Plan prints as
the table ``unimp explain`` shows.

>>> import unimp
>>> plan = compile_ops("demo", unimp.load("mixed_bf16"), control={"matmul": "op"}, native={})
>>> plan.op("matmul").dtype, plan.op("softmax").control
('bfloat16', 'fixed')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import UnsupportedError
from .fp8 import Fp8Plan, Fp8Support, plan_fp8
from .ops import CANONICAL_OPS
from .policy import LossScaleSpec, Policy
from .report import format_table

CONTROL_LEVELS = ("op", "layer", "fixed")


@dataclass(frozen=True)
class OpDecision:
    """One canonical op in one backend.

    ``requested``: the policy's category; ``dtype``: the dtype it will run in (None = follows its
    inputs); ``control``: op | layer | fixed; ``honoured``: False when the backend falls back.
    """

    op: str
    requested: str
    dtype: str | None
    control: str
    native: tuple[str, ...] = ()
    honoured: bool = True
    note: str = ""

    @property
    def runs_in(self) -> str:
        """The dtype, or how it is chosen: ``widest input`` (promote) or ``inputs``."""
        return self.dtype or ("widest input" if self.requested == "promote" else "inputs")


@dataclass(frozen=True)
class Plan:
    """What one backend will do with one policy."""

    backend: str
    policy: Policy
    compute_dtype: str
    compute_reason: str
    ops: tuple[OpDecision, ...]
    notes: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    param_fallback: str | None = None  # dtype low-precision params really hold, when the backend cannot lower them
    override_fallbacks: Mapping[int, str] = field(default_factory=dict)  # override index -> dtype that runs
    fp8: Fp8Plan | None = None  # the [fp8] part (unimp.fp8); None = built without FP8 support declared

    def op(self, name: str) -> OpDecision:
        for d in self.ops:
            if d.op == name:
                return d
        raise KeyError(name)

    @property
    def loss_scale(self) -> LossScaleSpec:
        """The loss-scale knobs to run: the policy's, except that ``auto`` resolved to float16
        turns a ``none`` mode into dynamic scaling (fp16 without scaling underflows)."""
        spec = self.policy.loss_scale
        if self.policy.compute_dtype == "auto" and self.compute_dtype == "float16" and spec.mode == "none":
            return dataclasses.replace(spec, mode="dynamic", skip_nonfinite=True)
        return spec

    @property
    def fallbacks(self) -> tuple[OpDecision, ...]:
        return tuple(d for d in self.ops if not d.honoured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "policy": self.policy.name, "fingerprint": self.policy.fingerprint,
            "compute_dtype": self.compute_dtype, "compute_reason": self.compute_reason,
            "ops": [{"op": d.op, "requested": d.requested, "dtype": d.dtype, "control": d.control,
                     "honoured": d.honoured, "native": list(d.native), "note": d.note} for d in self.ops],
            "notes": list(self.notes), "details": {k: _plain(v) for k, v in self.details.items()},
            "param_fallback": self.param_fallback,
            "override_fallbacks": {str(k): v for k, v in self.override_fallbacks.items()},
            "fp8": self.fp8.to_dict() if self.fp8 is not None else None,
        }

    def __str__(self) -> str:
        head = (f"Plan: policy {self.policy.name!r} ({self.policy.fingerprint}) on backend {self.backend}\n"
                f"compute dtype: {self.compute_dtype} ({self.compute_reason})\n")
        rows = []
        for d in self.ops:
            native = ", ".join(d.native[:4]) + (" ..." if len(d.native) > 4 else "")
            runs = d.runs_in + ("" if d.honoured else " (fallback)")
            rows.append((d.op, d.requested, runs, d.control, native))
        notes = [f"note: {n}" for n in self.notes] + [f"fallback: {d.op}: {d.note}" for d in self.fallbacks]
        notes += self.fp8.describe() if self.fp8 is not None else []
        return head + format_table(("op", "policy", "runs in", "control", "native"), rows, footer=notes)


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple | set | frozenset):
        return [_plain(x) for x in (sorted(v) if isinstance(v, set | frozenset) else v)]
    return v if isinstance(v, str | int | float | bool | type(None)) else repr(v)


def requested_dtype(policy: Policy, op: str, compute_dtype: str) -> str | None:
    """The dtype the policy asks for ``op`` (None = follow inputs / promote)."""
    return {"lower": compute_dtype, "float32": "float32"}.get(policy.ops.category(op))


def compile_ops(backend: str, policy: Policy, *, control: Mapping[str, str],
                native: Mapping[str, tuple[str, ...]], compute_dtype: str | None = None,
                compute_reason: str = "as the policy says",
                fixed: Mapping[str, tuple[str | None, str]] | None = None,
                notes: tuple[str, ...] = (), details: Mapping[str, Any] | None = None,
                fp8: Fp8Support | None = None) -> Plan:
    """Build a Plan, applying the policy's ``on_unsupported`` to what the backend cannot honour.

    ``control[op]`` is ``op`` or ``layer`` for ops the backend controls (missing = ``fixed``);
    ``fixed[op] = (dtype the framework uses or None for inputs, why)`` for ops it does not.
    A fixed op whose framework dtype differs from the request is an :class:`UnsupportedError`
    (``on_unsupported = "error"``) or a reported fallback. ``fp8``: what the backend can run in
    FP8 (None: nothing); the policy's ``[fp8]`` request is checked against it the same way
    (:func:`unimp.fp8.plan_fp8`).
    """
    low = compute_dtype or policy.compute_dtype
    fixed = fixed or {}
    decisions, problems = [], []
    for op in CANONICAL_OPS:
        want = requested_dtype(policy, op, low)
        level = control.get(op, "fixed")
        if level not in CONTROL_LEVELS:
            raise ValueError(f"control level {level!r} for {op} is not one of {CONTROL_LEVELS}")
        nat = tuple(native.get(op, ()))
        if level != "fixed":
            decisions.append(OpDecision(op, policy.ops.category(op), want, level, nat))
            continue
        actual, why = fixed.get(op, (want, "the framework decides; it matches the request"))
        if actual == want:
            decisions.append(OpDecision(op, policy.ops.category(op), want, "fixed", nat, True, why))
            continue
        problems.append(f"{op}: policy asks {want or 'input dtype'}, {backend} runs it in "
                        f"{actual or 'its input dtype'} ({why})")
        decisions.append(OpDecision(op, policy.ops.category(op), actual, "fixed", nat, False, why))
    if problems and policy.on_unsupported == "error":
        raise UnsupportedError(
            f"policy {policy.name!r} ({policy.source}) cannot be honoured by backend {backend}:\n  "
            + "\n  ".join(problems)
            + "\nfix: change the policy's op lists, or set on_unsupported = \"fallback\" to run these "
              "as reported in the Plan")
    return Plan(backend, policy, low, compute_reason, tuple(decisions), tuple(notes), dict(details or {}),
                fp8=plan_fp8(policy, backend, fp8))
