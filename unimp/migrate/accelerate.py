"""Accelerate: ``Accelerator(mixed_precision="no"|"fp16"|"bf16"|"fp8", kwargs_handlers=[GradScalerKwargs(...)])``,
both directions (a ``mixed_precision:`` line of an ``accelerate config`` YAML file works too).

Defaults read from accelerate/utils/dataclasses.py (GradScalerKwargs): init_scale 65536.0,
growth_factor 2.0, backoff_factor 0.5, growth_interval 2000, enabled True; fp16 and bf16 run
``torch.autocast`` on the accelerator (CUDA lists), fp16 with ``torch.amp.GradScaler``.

>>> import_policy("bf16").policy.compute_dtype
'bfloat16'
>>> export_policy(import_policy("fp16").policy).config["GradScalerKwargs"]["growth_interval"]
2000
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..policy import Policy
from . import torch as torch_amp
from .common import Draft, Exported, Imported, bad, check_keys, finish, kwargs_of, leading_name, refuse

SYSTEM = "accelerate"
PRECISIONS = ("no", "fp16", "bf16", "fp8")
SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def import_policy(mixed_precision: str = "no", grad_scaler_kwargs: Mapping[str, Any] | None = None, *,
                  source: str = "accelerate", ignored: tuple[str, ...] = ()) -> Imported:
    """The policy of ``Accelerator(mixed_precision=..., kwargs_handlers=[GradScalerKwargs(**grad_scaler_kwargs)])``."""
    if mixed_precision not in PRECISIONS:
        raise bad(source, "mixed_precision", f"{mixed_precision!r} is not one of {', '.join(PRECISIONS)}")
    if mixed_precision == "fp8":
        raise refuse(source, "mixed_precision", "'fp8' (Transformer Engine / MS-AMP / torchao recipes) has no "
                     "unimp dtype", "import 'bf16' (what Accelerate runs outside the fp8 layers) and keep the fp8 "
                     "recipe in Accelerate")
    kw = dict(grad_scaler_kwargs or {})
    check_keys(kw, SCALER_KEYS, source, "GradScalerKwargs.")
    if kw and mixed_precision != "fp16":
        raise refuse(source, "GradScalerKwargs", f"Accelerate uses a GradScaler only with fp16, not "
                     f"{mixed_precision!r}", "remove GradScalerKwargs or use mixed_precision='fp16'")
    if mixed_precision == "no":
        d = Draft(SYSTEM, source, "fp32", "mixed_precision='no': full precision")
    else:
        d = Draft(SYSTEM, source, "torch_autocast_cuda", f"mixed_precision={mixed_precision!r}: torch.autocast "
                  f"on the accelerator (CUDA op lists)")
        if mixed_precision == "bf16":
            d.set("compute_dtype", "bfloat16", "mixed_precision='bf16'")
            d.set("loss_scale.mode", "none", "mixed_precision='bf16': no GradScaler")
            d.set("loss_scale.skip_nonfinite", False, "mixed_precision='bf16': every step is taken")
        else:
            d.set("compute_dtype", "float16", "mixed_precision='fp16'")
            torch_amp.add_scaler(d, kw, prefix="GradScalerKwargs.")
    d.ignored.extend(ignored)
    return d.build()


def from_cli(raw: Any, source: str) -> Imported:
    name, raw = leading_name(raw)
    if name is not None:
        scaler = kwargs_of(raw, source, {"GradScalerKwargs": "scaler"}).get("scaler") if raw.strip() else None
        return import_policy(name, scaler, source=source)
    if isinstance(raw, Mapping) and "mixed_precision" in raw:  # an `accelerate config` file
        rest = tuple(k for k in raw if k not in ("mixed_precision", "GradScalerKwargs"))
        return import_policy(raw["mixed_precision"], raw.get("GradScalerKwargs"), source=source, ignored=rest)
    kw = kwargs_of(raw, source, {"Accelerator": "accelerator", "GradScalerKwargs": "scaler"})
    acc = kw.get("accelerator", {})
    check_keys(acc, ("mixed_precision",), source, "Accelerator.")
    return import_policy(acc.get("mixed_precision", "no"), kw.get("scaler"), source=source)


def export_policy(policy: Policy) -> Exported:
    """``{"mixed_precision": ..., "GradScalerKwargs": {...}}`` for the policy."""
    mp = {"float16": "fp16", "bfloat16": "bf16"}.get(policy.compute_dtype, "no")
    cfg: dict[str, Any] = {"mixed_precision": mp}
    if mp == "fp16":
        cfg["GradScalerKwargs"] = torch_amp.scaler_kwargs(policy)
    handler = ""
    if "GradScalerKwargs" in cfg:
        args = ", ".join(f"{k}={v!r}" for k, v in cfg["GradScalerKwargs"].items())
        handler = f", kwargs_handlers=[GradScalerKwargs({args})]"
    text = f"accelerator = Accelerator(mixed_precision={mp!r}{handler})\n"
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(c["mixed_precision"], c.get("GradScalerKwargs")))
