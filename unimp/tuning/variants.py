"""The policies sensitivity and tuning run: each is the user's policy with first overrides keeping some
of the candidate layers (those the policy lowers) out of the target.

The *reference* keeps every candidate high (float32 for a bfloat16/float16 target, the compute dtype
for FP8; everything else runs as the policy says, so a layer's neighbours see the dtypes they will see);
a *lowering* keeps all but one; the *tuned* policy keeps the sensitive ones. Overrides name a layer by
its exact path (:func:`literal_glob`).

>>> import unimp
>>> p, up, head = unimp.load("fp8_tensorwise"), Candidate("up", "linear", None), Candidate("head", "linear", None)
>>> target_of(p, "bfloat16", None), [o.modules for o in reference(p, "fp8", [up, head]).overrides]
('fp8', [('up',), ('head',)])
>>> lowering(p, "fp8", [up, head], up).overrides
(Override(modules=('head',), types=(), compute_dtype=None, param_dtype=None, fp8=False),)
>>> [(t["modules"], len(layers)) for t, layers in keep_overrides("fp8", [up, head], room=1)]
[(['up', 'head'], 2)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from unimp.dtypes import is_low
from unimp.errors import TuneError
from unimp.plan.fp8 import requests_fp8
from unimp.policy import Override, Policy
from unimp.policy.spec import MAX_ITEMS, MAX_NAME

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


def keep_override(target: str, layer: Candidate) -> dict[str, Any]:
    """The override that keeps ``layer`` out of ``target``: ``fp8 = false``, or float32 compute (and float32
    params where the target lowers them)."""
    if target == "fp8":
        return {"modules": [literal_glob(layer.path)], "fp8": False}
    keep: dict[str, Any] = {"modules": [literal_glob(layer.path)], "compute_dtype": "float32"}
    if layer.param_dtype != "float32":
        keep["param_dtype"] = "float32"
    return keep


def keep_overrides(target: str, kept: Sequence[Candidate], room: int = MAX_ITEMS) -> list[tuple[dict[str, Any],
                                                                                                list[Candidate]]]:
    """The overrides keeping ``kept`` out of ``target``, each with the layers it holds: one per layer when they fit
    in ``room`` overrides, else one per kind of override and up to ``MAX_ITEMS`` layers."""
    one = [(keep_override(target, c), [c]) for c in kept]
    if len(one) <= room:
        return one
    groups: dict[tuple[tuple[str, Any], ...], list[Candidate]] = {}
    for table, layers in one:
        groups.setdefault(tuple((k, v) for k, v in table.items() if k != "modules"), []).extend(layers)
    return [({"modules": [literal_glob(c.path) for c in layers[i:i + MAX_ITEMS]], **dict(rest)},
             layers[i:i + MAX_ITEMS]) for rest, layers in groups.items() for i in range(0, len(layers), MAX_ITEMS)]


def keeping(policy: Policy, target: str, kept: Sequence[Candidate], name: str | None = None) -> Policy:
    """``policy`` with the ``kept`` layers held out of ``target`` (first overrides; the policy's own follow)."""
    own = [_table(o) for o in policy.overrides]
    ours = [table for table, _ in keep_overrides(target, kept, MAX_ITEMS - len(own))]
    return policy.replace(name=name or _named(policy, "tuned"), overrides=[*ours, *own])


def reference(policy: Policy, target: str, candidates: Sequence[Candidate]) -> Policy:
    """Every candidate layer kept out of ``target`` (the rest as ``policy`` runs it): what lowering one is compared
    with, and the tuned policy that lowers none of them."""
    return keeping(policy, target, candidates, _named(policy, "reference"))


def lowering(policy: Policy, target: str, candidates: Sequence[Candidate], layer: Candidate) -> Policy:
    """The reference with ``layer`` alone lowered to ``target``."""
    return keeping(policy, target, [c for c in candidates if c != layer], _named(policy, "one-layer"))


def _table(override: Override) -> dict[str, Any]:
    """An override as a file writes it (only the keys it sets)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(override).items() if v not in (None, ())}
