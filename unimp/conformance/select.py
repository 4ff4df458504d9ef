"""Which checks a backend must pass, from the capability tags it declares (scikit-learn's
``check_estimator`` style: an explicit table check -> required tags, policy -> required tags).

A backend declares ``tags`` on its :class:`unimp.backend.Backend` class; the suite runs every
(check, policy) case those tags allow and reports the others as not applicable, naming the
missing tags, instead of discovering n/a at run time.

>>> required("check_master_weights", "pure_bf16") >= {"master_weights", "bf16"}
True
>>> missing({"fp16", "training"}, "check_numerics", "mixed_fp16")
frozenset()
>>> sorted(missing({"fp16"}, "check_numerics", "mixed_bf16"))
['bf16', 'training']
"""

from __future__ import annotations

from collections.abc import Iterable

CHECK_TAGS: dict[str, frozenset[str]] = {
    "check_layer_dtypes": frozenset(),
    "check_output_dtype": frozenset(),
    "check_master_weights": frozenset({"training", "master_weights"}),
    "check_loss_scale_trajectory": frozenset({"training", "loss_scaling"}),
    "check_state_dict_roundtrip": frozenset({"training", "loss_scaling"}),
    "check_overrides": frozenset({"overrides"}),
    "check_alignment_findings": frozenset({"layout"}),
    "check_numerics": frozenset({"training"}),
    "check_remove_restores": frozenset({"remove"}),
    "check_amp_surface": frozenset({"remove"}),
    "check_loss_scale_follows_plan": frozenset({"fp16", "training", "loss_scaling"}),
    "check_auto_policy": frozenset({"overrides"}),
    # unimp.conformance.fp8: which FP8 recipe runs is then the backend's Plan (its declared Fp8Support)
    "check_fp8_layers": frozenset(),
    "check_fp8_numerics": frozenset({"training"}),
    "check_fp8_state_dict": frozenset({"training"}),
}
# checks of one aspect of the Plan run under these policies only (the others under every standard policy)
CHECK_POLICIES: dict[str, tuple[str, ...]] = {
    "check_amp_surface": ("fp32", "mixed_bf16", "mixed_fp16"),
    "check_loss_scale_follows_plan": ("fp32",),
    "check_auto_policy": ("mixed_bf16",),
}
POLICY_TAGS: dict[str, frozenset[str]] = {
    "fp32": frozenset(),
    "mixed_bf16": frozenset({"bf16"}),
    "pure_bf16": frozenset({"bf16", "master_weights"}),
    "mixed_fp16": frozenset({"fp16"}),
    "custom_moved_ops": frozenset({"bf16", "overrides"}),
    "fp8_tensorwise": frozenset({"bf16"}),
    "fp8_delayed": frozenset({"bf16"}),
    "fp8_rowwise": frozenset({"bf16"}),
}


def required(check: str, policy: str) -> frozenset[str]:
    """The tags a backend needs for ``check`` under ``policy`` (KeyError for a check not in the table)."""
    return CHECK_TAGS[check] | POLICY_TAGS.get(policy, frozenset())


def missing(tags: Iterable[str], check: str, policy: str) -> frozenset[str]:
    """The tags ``check[policy]`` needs that a backend with ``tags`` lacks (empty: it must pass)."""
    return required(check, policy) - frozenset(tags)


def reason(tags: Iterable[str], check: str, policy: str) -> str | None:
    """Why ``check[policy]`` is not applicable to a backend with ``tags`` (None: it applies)."""
    lack = missing(tags, check, policy)
    return f"the backend does not declare the tags {', '.join(sorted(lack))}" if lack else None
