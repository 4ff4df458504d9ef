"""The policies sensitivity and tuning run: the reference, one layer lowered alone, the tuned policy.

Every variant is an ordinary :class:`~unimp.Policy` built from the user's: the *reference* runs every
layer at the high precision the target is compared with (float32 for a bfloat16/float16 target; the
policy's compute dtype, FP8 off, for an FP8 target); a *lowering* is the reference with one first
override lowering one layer; the *tuned* policy is the user's with first overrides keeping some
layers high. Overrides name a layer by its exact path (:func:`literal_glob`).

>>> import unimp
>>> p = unimp.load("fp8_tensorwise")
>>> target_of(p, "bfloat16", None), reference(p, "fp8").fp8.enabled
('fp8', False)
>>> lowering(reference(p, "fp8"), "fp8", Candidate("blocks.0.up", "linear", "bfloat16")).overrides[0]
Override(modules=('blocks.0.up',), types=(), compute_dtype=None, param_dtype=None, fp8=True)
>>> keeping(p, "fp8", [Candidate("embed", "linear", "bfloat16")]).overrides[0].fp8
False
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from unimp.dtypes import is_low
from unimp.errors import TuneError
from unimp.plan.fp8 import requests_fp8
from unimp.policy import Policy
from unimp.policy.spec import MAX_NAME

TARGETS = {"fp8": "fp8", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


@dataclass(frozen=True)
class Candidate:
    """One layer the target policy lowers: its path, canonical kind, and what it is lowered to
    (``compute_dtype``/``param_dtype`` for a dtype target; ``recipe`` for FP8)."""

    path: str
    kind: str | None
    compute_dtype: str | None
    param_dtype: str = "float32"
    recipe: str | None = None


def target_of(policy: Policy, compute_dtype: str, target: Any) -> str:
    """``"fp8"``, ``"bfloat16"`` or ``"float16"``: what ``policy`` lowers to (``compute_dtype``: its
    resolved compute dtype on the backend), checked against the ``target`` argument (None: the policy's)."""
    asks_fp8 = requests_fp8(policy)
    if target is None:
        if asks_fp8:
            return "fp8"
        if not is_low(compute_dtype):
            raise TuneError(f"policy {policy.name!r} runs in {compute_dtype}: it lowers nothing to tune; pass a "
                            f"policy that lowers (e.g. 'mixed_bf16', 'mixed_fp16', 'fp8_tensorwise')")
        return compute_dtype
    if not isinstance(target, str) or target not in TARGETS:
        raise TuneError(f"target={target!r:.60}: expected one of 'fp8', 'bf16', 'fp16' (or None: what the policy "
                        f"lowers to)")
    want = TARGETS[target]
    if want == "fp8" and not asks_fp8:
        raise TuneError(f"target='fp8': policy {policy.name!r} asks no FP8 ([fp8] enabled = false, no override "
                        f"fp8 = true); pass an FP8 policy (e.g. 'fp8_tensorwise', 'fp8_rowwise') or "
                        f"target={_short(compute_dtype)!r}")
    if want != "fp8" and asks_fp8:
        raise TuneError(f"target={target!r}: policy {policy.name!r} asks FP8; its layers are tuned between FP8 and "
                        f"{compute_dtype} with target='fp8', or pass a policy without FP8 (e.g. "
                        f"'mixed_{_short(want)}') to tune {want} against float32")
    if want != "fp8" and want != compute_dtype:
        raise TuneError(f"target={target!r}: policy {policy.name!r} computes in {compute_dtype}, not {want}; pass "
                        f"target={_short(compute_dtype)!r} or a policy with compute_dtype = {want!r}")
    return want


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def high_of(target: str, compute_dtype: str) -> str:
    """The precision a layer kept out of ``target`` runs in (the reference's)."""
    return compute_dtype if target == "fp8" else "float32"


def literal_glob(path: str) -> str:
    """An override glob matching exactly ``path`` (fnmatch's ``*``, ``?`` and ``[`` escaped).

    >>> literal_glob("blocks[0].attn*")
    'blocks[[]0].attn[*]'
    """
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


def _named(policy: Policy, suffix: str) -> str:
    return f"{policy.name[:MAX_NAME - len(suffix) - 1]}-{suffix}"


def reference(policy: Policy, target: str) -> Policy:
    """Every layer at the high precision ``target`` is compared with: the policy without FP8 (its own
    dtypes and overrides) for ``"fp8"``; float32 everywhere (no overrides) for a dtype target."""
    if target == "fp8":
        overrides = [o for o in (_plain({**_table(o), "fp8": None}) for o in policy.overrides) if o]
        return policy.replace(name=_named(policy, "reference"), fp8={"enabled": False}, overrides=overrides)
    return policy.replace(name=_named(policy, "reference"), compute_dtype="float32", param_dtype="float32",
                          fp8={"enabled": False}, overrides=[])


def lowering(ref: Policy, target: str, layer: Candidate) -> Policy:
    """``ref`` with ``layer`` alone lowered to ``target`` (one first override)."""
    if target == "fp8":
        first: dict[str, Any] = {"modules": [literal_glob(layer.path)], "fp8": True}
    else:
        first = {"modules": [literal_glob(layer.path)], "compute_dtype": layer.compute_dtype,
                 "param_dtype": layer.param_dtype}
    return ref.replace(name=_named(ref, "one-layer"), overrides=[first, *map(_table, ref.overrides)])


def keep_override(target: str, layer: Candidate) -> dict[str, Any]:
    """The override that keeps ``layer`` out of ``target``: ``fp8 = false``, or float32 compute (and float32
    params where the target lowers them)."""
    if target == "fp8":
        return {"modules": [literal_glob(layer.path)], "fp8": False}
    keep: dict[str, Any] = {"modules": [literal_glob(layer.path)], "compute_dtype": "float32"}
    if layer.param_dtype != "float32":
        keep["param_dtype"] = "float32"
    return keep


def keeping(policy: Policy, target: str, kept: Iterable[Candidate], name: str | None = None) -> Policy:
    """``policy`` with the ``kept`` layers held out of ``target`` (first overrides; the policy's own follow)."""
    ours = [keep_override(target, c) for c in kept]
    return policy.replace(name=name or _named(policy, "tuned"), overrides=[*ours, *map(_table, policy.overrides)])


def _table(override: Any) -> dict[str, Any]:
    """An override as the file writes it (only the keys it sets)."""
    return _plain({"modules": list(override.modules), "types": list(override.types),
                   "compute_dtype": override.compute_dtype, "param_dtype": override.param_dtype,
                   "fp8": override.fp8} if not isinstance(override, dict) else override)


def _plain(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` without unset keys; empty when it would change nothing."""
    out = {k: v for k, v in table.items() if v not in (None, [], ())}
    return out if any(k in out for k in ("compute_dtype", "param_dtype", "fp8")) else {}
