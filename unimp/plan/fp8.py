"""FP8 training, decided once for every backend: the Plan's ``Fp8Plan`` and the per-layer decision.

A backend declares what it can run (:class:`Fp8Support`); :func:`plan_fp8` checks the policy's
``[fp8]`` table and per-override ``fp8 = true|false`` against it (``on_unsupported``: error, or a
reported fallback to the compute dtype) and :func:`decide_fp8` says, per layer, FP8 or not, with
the recipe and the reason. Backends call these; none re-derives the rules.

>>> import unimp
>>> policy = unimp.load("fp8_tensorwise")
>>> decide_fp8(policy, "mlp.up", "linear", ("Linear",), {"in_features": 64, "out_features": 256}).recipe
'tensorwise'
>>> d = decide_fp8(policy, "head", "linear", ("Linear",), {"in_features": 64, "out_features": 33})
>>> d.fp8, d.reason
(False, 'out_features=33 is not a multiple of fp8.dims_multiple (16); stays in bfloat16')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from unimp.dtypes import is_low
from unimp.errors import UnsupportedError
from unimp.policy import Policy
from unimp.policy.spec import FP8_OPS, FP8_RECIPES


@dataclass(frozen=True)
class Fp8Support:
    """What one backend can run in FP8 on this framework version and device.

    ``recipes[recipe]``: how it runs (the native call, for the Plan); ``why_not[recipe]``: why a
    recipe cannot run; ``missing``: why nothing can (then ``recipes`` is empty).
    """

    ops: tuple[str, ...] = ()
    recipes: Mapping[str, str] = field(default_factory=dict)
    gradient_formats: tuple[str, ...] = ("e5m2", "e4m3")
    why_not: Mapping[str, str] = field(default_factory=dict)
    missing: str = ""
    notes: tuple[str, ...] = ()

    @classmethod
    def everything(cls) -> Fp8Support:
        """Every op and recipe: what the policy alone asks (``decide_fp8`` on a bare Policy)."""
        return cls(ops=FP8_OPS, recipes=dict.fromkeys(FP8_RECIPES, "as the policy says"))


@dataclass(frozen=True)
class Fp8Plan:
    """The ``[fp8]`` part of a Plan.

    ``requested``: the policy asks FP8 somewhere (``[fp8] enabled`` or an override ``fp8 = true``);
    ``active``: FP8 will run (requested and the backend can); ``ops``: the canonical ops that run
    FP8 by the table; ``capable``: those the backend can run FP8 at all (what an override may ask);
    ``fallback``: why a request does not run FP8 (``on_unsupported = "fallback"``), else None.
    """

    requested: bool
    active: bool
    recipe: str
    ops: tuple[str, ...]
    capable: tuple[str, ...]
    forward_format: str
    gradient_format: str
    amax_history: int
    dims_multiple: int
    native: str = ""
    fallback: str | None = None
    notes: tuple[str, ...] = ()

    def describe(self) -> list[str]:
        """Lines for ``unimp explain`` (empty when the policy asks no FP8)."""
        if not self.requested:
            return []
        if not self.active:
            return [f"fp8: fallback to the compute dtype: {self.fallback}"]
        history = f", amax history {self.amax_history}" if self.recipe == "delayed" else ""
        ops = ", ".join(self.ops) or "none by the table (overrides only)"
        lines = [f"fp8: recipe {self.recipe} ({self.forward_format} forward, {self.gradient_format} "
                 f"gradients{history}) for {ops}; layers whose dims are not multiples of "
                 f"{self.dims_multiple} stay in the compute dtype (reported)"]
        if self.native:
            lines.append(f"fp8: runs as {self.native}")
        return lines + [f"fp8: {n}" for n in self.notes]

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


@dataclass(frozen=True)
class Fp8Decision:
    """One layer: FP8 or not, the recipe when it is, and why."""

    path: str
    fp8: bool
    recipe: str | None
    reason: str

    @staticmethod
    def report_notes(decisions: Iterable[Fp8Decision]) -> list[str]:
        """The report's lines for the layers that asked FP8 and did not get it (:func:`fp8_report_notes`)."""
        return fp8_report_notes(decisions)


def requests_fp8(policy: Policy) -> bool:
    """Whether ``policy`` asks FP8 anywhere (the table or an override ``fp8 = true``)."""
    return policy.fp8.enabled or any(o.fp8 for o in policy.overrides)


def plan_fp8(policy: Policy, backend: str, support: Fp8Support | None) -> Fp8Plan:
    """The Fp8Plan of ``policy`` on a backend that can do ``support`` (None: no FP8 at all).

    What the backend cannot honour is an :class:`UnsupportedError` naming it, or with
    ``on_unsupported = "fallback"`` the reported fallback: the layers stay in the compute dtype
    (a recipe or format it lacks) or the ops it lacks are dropped.
    """
    spec = policy.fp8
    support = support or Fp8Support(missing=f"backend {backend} has no FP8 training path")
    requested = requests_fp8(policy)
    asked = Fp8Plan(requested, False, spec.recipe, tuple(o for o in spec.ops if o in support.ops), support.ops,
                    spec.forward_format, spec.gradient_format, spec.amax_history, spec.dims_multiple)
    if not requested:
        return asked
    fatal: list[str] = []
    if support.missing or not support.recipes:
        fatal.append(support.missing or f"backend {backend} runs no FP8 recipe")
    elif spec.recipe not in support.recipes:
        why = support.why_not.get(spec.recipe, "not implemented")
        can = ", ".join(support.recipes)
        fatal.append(f"fp8.recipe = {spec.recipe!r}: backend {backend} cannot run it ({why}); it runs {can}")
    elif spec.gradient_format not in support.gradient_formats:
        fatal.append(f"fp8.gradient_format = {spec.gradient_format!r}: backend {backend} takes "
                     f"{', '.join(support.gradient_formats)}")
    dropped = [o for o in spec.ops if o not in support.ops] if spec.enabled else []
    minor = [f"fp8.ops: {o!r}: backend {backend} runs FP8 only for {', '.join(support.ops) or 'no op'}"
             for o in dropped]
    problems = fatal + ([] if fatal else minor)
    if problems and policy.on_unsupported == "error":
        raise UnsupportedError(
            f"policy {policy.name!r} ({policy.source}) asks FP8 that backend {backend} cannot run:\n  "
            + "\n  ".join(problems)
            + "\nfix: change the [fp8] table (or the overrides' fp8), or set on_unsupported = \"fallback\" "
              "to run these layers in the compute dtype, as reported in the Plan")
    if fatal:
        return dataclasses.replace(asked, ops=(), fallback="; ".join(fatal))
    notes = (*(f"fallback: {m} (runs in the compute dtype)" for m in minor), *support.notes)
    return dataclasses.replace(asked, active=True, native=support.recipes[spec.recipe], notes=tuple(notes))


class Planned(Protocol):
    """What :func:`decide_fp8` reads of a :class:`unimp.plan.Plan` (typed here: the Plan holds an Fp8Plan).

    Read-only members: a frozen Plan (or any object with these attributes) satisfies it.
    """

    @property
    def backend(self) -> str: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def compute_dtype(self) -> str: ...
    @property
    def fp8(self) -> Fp8Plan | None: ...


def _parts(source: Planned | Policy, compute_dtype: str | None) -> tuple[Policy, Fp8Plan, str]:
    if isinstance(source, Policy):  # `auto` resolves per backend: a bare policy stands in bfloat16 for it
        low = compute_dtype or source.compute_dtype
        return source, plan_fp8(source, "policy", Fp8Support.everything()), "bfloat16" if low == "auto" else low
    fp8 = source.fp8 if source.fp8 is not None else plan_fp8(source.policy, source.backend, None)
    return source.policy, fp8, compute_dtype or source.compute_dtype


def decide_fp8(source: Planned | Policy, path: str, kind: str | None, type_names: Iterable[str] = (),
               dims: Mapping[str, int] | None = None, compute_dtype: str | None = None) -> Fp8Decision:
    """FP8 or not for the layer at ``path`` of canonical ``kind``, with the recipe and the reason.

    ``source`` is a backend's Plan (what that backend can run) or a bare Policy (what it asks);
    ``dims`` are the layer's GEMM dims by name (``{"in_features": 64, "out_features": 33}``).
    Rules, in order: FP8 must be active in the Plan; the first override that sets ``fp8`` decides
    (``true`` needs an op the backend can run FP8); else ``[fp8] enabled`` and ``kind`` in
    ``fp8.ops``, and the policy must run the layer in a low compute dtype (an override to float32
    keeps it there); then every dim must be a multiple of ``fp8.dims_multiple``.
    """
    policy, fp8, low = _parts(source, compute_dtype)
    names = (*tuple(type_names), *((kind,) if kind else ()))
    if not fp8.active:
        return Fp8Decision(path, False, None, fp8.fallback or "the policy asks no FP8")
    hit = policy.override_for(path, names, sets="fp8")
    if hit is not None and not hit[1].fp8:
        return Fp8Decision(path, False, None, f"overrides[{hit[0]}] sets fp8 = false")
    if hit is not None:
        if kind not in fp8.capable:
            return Fp8Decision(path, False, None, f"overrides[{hit[0]}] sets fp8 = true, but FP8 runs only for "
                                                  f"{', '.join(fp8.capable) or 'no op'} (this is {kind or 'no op'})")
    else:
        if not policy.fp8.enabled:
            return Fp8Decision(path, False, None, "fp8.enabled = false and no override sets fp8 = true")
        if kind not in fp8.ops:
            return Fp8Decision(path, False, None, f"{kind or 'this layer'} is not in fp8.ops")
        dtype = policy.decide(path, kind, type_names, low)
        if not (dtype.compute_dtype and is_low(dtype.compute_dtype)):
            where = f"overrides[{dtype.override}]" if dtype.override is not None else "the policy"
            return Fp8Decision(path, False, None, f"{where} runs it in {dtype.compute_dtype or 'its input dtype'}")
    bad = [f"{k}={v}" for k, v in (dims or {}).items() if v % fp8.dims_multiple]
    if bad:
        stays = policy.decide(path, kind, type_names, low).compute_dtype or low
        return Fp8Decision(path, False, None, f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a "
                                              f"multiple of fp8.dims_multiple ({fp8.dims_multiple}); "
                                              f"stays in {stays}")
    return Fp8Decision(path, True, fp8.recipe, f"{fp8.recipe} ({fp8.forward_format}/{fp8.gradient_format})")


def asks_fp8(plan: Planned, path: str, kind: str | None, type_names: Iterable[str] = ()) -> bool:
    """Whether the policy asks FP8 of this layer at all (a backend then reports its decision).

    >>> import unimp
    >>> asks_fp8(unimp.load("fp8_tensorwise"), "head", "linear", ("Linear",))
    True
    """
    if isinstance(plan, Policy):
        policy, requested = plan, requests_fp8(plan)
    else:
        policy, requested = plan.policy, plan.fp8 is not None and plan.fp8.requested
    if not requested:
        return False
    names = (*tuple(type_names), *((kind,) if kind else ()))
    return kind in policy.fp8.ops or policy.override_for(path, names, sets="fp8") is not None


def fp8_report_notes(decisions: Iterable[Fp8Decision]) -> list[str]:
    """The report's lines for the layers that asked FP8 and did not get it (the dims rule, overrides)."""
    return [f"fp8: {d.path or '<model>'} not FP8: {d.reason}" for d in decisions if not d.fp8]
