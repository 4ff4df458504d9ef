"""The export check: re-import the native configuration an exporter wrote and list each policy key it does
not reproduce (:func:`finish`), and the merge of an export into the user's own config file (:func:`merge_into`).

>>> import unimp
>>> unexpressed(unimp.load("mixed_fp16"), unimp.load("mixed_bf16"), "x")[0]
'compute_dtype = "float16": x cannot express it (its configuration gives "bfloat16")'
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from unimp.errors import UnimpWarning
from unimp.loss_scale import f32
from unimp.migrate.draft import Exported, Imported, toml_value
from unimp.policy import Policy
from unimp.policy.resolve import flatten
from unimp.policy.spec import AUTO_INITIAL

_DYNAMIC_ONLY = ("initial", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min", "max",
                 "growth_schedule", "on_max", "growth_requires_finite", "hysteresis_refill", "at_min",
                 "scale_dtype", "subnormal", "factor_arithmetic", "backoff")


def effective(policy: Policy, auto_initial: float = AUTO_INITIAL) -> dict[str, Any]:
    """The policy's keys that change behaviour (``name``, knobs of an unused mode, and the factor
    arithmetic when both factors are float32 values, left out), ``loss_scale.initial = "auto"`` as the
    number it starts at where the framework's own scaler starts at ``auto_initial``."""
    flat = flatten(policy.to_dict())
    flat.pop("name", None)
    if flat.get("loss_scale.initial") == "auto":
        flat["loss_scale.initial"] = auto_initial
    mode = flat.get("loss_scale.mode")
    for k in _DYNAMIC_ONLY:
        if mode != "dynamic" and not (mode == "static" and k == "initial"):
            flat.pop(f"loss_scale.{k}", None)
    factors = (flat.get("loss_scale.growth_factor"), flat.get("loss_scale.backoff_factor"))
    if all(f is None or f32(f) == f for f in factors):
        flat.pop("loss_scale.factor_arithmetic", None)  # float32 factors: both arithmetics round the same product
    g = flat.get("loss_scale.growth_factor")
    if g is not None and math.frexp(g)[0] == 0.5 and flat.get("loss_scale.backoff_factor") == 1.0 / g:
        flat.pop("loss_scale.backoff", None)  # a power-of-two factor: scale / g and scale * (1 / g) are one product
    if flat.get("param_dtype") == "float32":
        flat = {k: v for k, v in flat.items() if not k.startswith("master_weights.")}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items()}


def unexpressed(policy: Policy, native: Policy, system: str, auto_initial: float = AUTO_INITIAL) -> tuple[str, ...]:
    """One line per key whose value the native configuration does not reproduce (``auto_initial``: where
    ``system``'s own scaler starts, what a policy's ``loss_scale.initial = "auto"`` runs there)."""
    ours, theirs = effective(policy, auto_initial), effective(native)
    lines = []
    for key in sorted({*ours, *theirs}):
        a, b = ours.get(key), theirs.get(key)
        if key.startswith("ops.") and isinstance(a, tuple) and isinstance(b, tuple) and sorted(a) == sorted(b):
            continue  # an op category is a set: the order of its list changes nothing
        if a is not None and a != b:
            lines.append(f"{key} = {_fmt(a)}: {system} cannot express it (its configuration gives {_fmt(b)})")
    return tuple(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "nothing"
    return toml_value(v)


def finish(system: str, policy: Policy, config: Any, text: str,
           reimport: Callable[[Any], Imported], auto_initial: float = AUTO_INITIAL) -> Exported:
    """An :class:`Exported` whose ``unexpressed`` is what re-importing ``config`` does not give back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        native = reimport(config).policy
    return Exported(system, config, text, unexpressed(policy, native, system, auto_initial))


def merge_into(original: Mapping[str, Any], config: Mapping[str, Any],
               owned: tuple[str, ...]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``original`` (the user's own config file) with only its precision keys (``owned``) taken from
    ``config`` (the export): a section both hold is updated key by key (its other keys kept), an owned
    key the export lacks is removed, every other key is kept verbatim and in place. Returns the merged
    config and one line per top-level key changed.

    >>> merge_into({"fp16": {"enabled": True, "auto_cast": False}, "zero_optimization": {"stage": 3}},
    ...            {"bf16": {"enabled": True}}, ("fp16", "bf16"))
    ({'zero_optimization': {'stage': 3}, 'bf16': {'enabled': True}}, ('fp16 (removed)', 'bf16 (added)'))
    """
    out: dict[str, Any] = {}
    changed: list[str] = []
    for key, value in original.items():
        if key not in owned:
            out[key] = value
        elif key in config:
            new = config[key]
            out[key] = {**value, **new} if isinstance(value, Mapping) and isinstance(new, Mapping) else new
            if out[key] != value:
                changed.append(key)
        else:
            changed.append(f"{key} (removed)")
    for key, value in config.items():
        if key not in original:
            out[key] = value
            changed.append(f"{key} (added)")
    return out, tuple(changed)
