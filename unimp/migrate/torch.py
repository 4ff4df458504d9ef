"""torch: ``torch.amp.GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval,
enabled)`` (with ``torch.autocast`` float16 on that device), both directions.

Defaults read from torch/amp/grad_scaler.py: init_scale 2**16, growth_factor 2.0, backoff_factor
0.5, growth_interval 2000, enabled True, device "cuda".

>>> imp = import_policy(init_scale=1024.0, growth_interval=100)
>>> imp.policy.loss_scale.initial, imp.policy.loss_scale.growth_interval
(1024.0, 100)
>>> export_policy(imp.policy).config["growth_interval"]
100
"""

from __future__ import annotations

from typing import Any

from ..policy import Policy
from .common import Draft, Exported, Imported, bad, check_keys, finish, kwargs_of, take

SYSTEM = "torch"
DEFAULTS = {"device": "cuda", "init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 2000, "enabled": True}


def import_policy(*, source: str = "torch.amp.GradScaler", **kwargs: Any) -> Imported:
    """The policy of ``torch.autocast(device, float16)`` + ``torch.amp.GradScaler(**kwargs)``."""
    check_keys(kwargs, DEFAULTS, source)
    device = kwargs.get("device", "cuda")
    if device not in ("cuda", "cpu"):
        raise bad(source, "device", f"{device!r}: unimp reproduces torch's 'cuda' and 'cpu' autocast lists")
    d = Draft(SYSTEM, source, extends=f"torch_autocast_{device}",
              why=f"torch.autocast('{device}') op lists" + ("" if "device" in kwargs else " (device not given)"))
    if device == "cpu":
        d.set("compute_dtype", "float16", "GradScaler implies float16 autocast")
    add_scaler(d, kwargs)
    return d.build()


def add_scaler(d: Draft, kwargs: dict[str, Any], prefix: str = "") -> None:
    """The loss-scale keys of ``GradScaler(**kwargs)`` (also Accelerate's ``GradScalerKwargs``)."""
    enabled = take(d, "loss_scale.mode", kwargs, "enabled", True, kind=bool, prefix=prefix,
                   convert=lambda on: "dynamic" if on else "none")
    if enabled == "dynamic":
        take(d, "loss_scale.initial", kwargs, "init_scale", 65536.0, prefix=prefix)
        take(d, "loss_scale.growth_factor", kwargs, "growth_factor", 2.0, prefix=prefix)
        take(d, "loss_scale.backoff_factor", kwargs, "backoff_factor", 0.5, prefix=prefix)
        take(d, "loss_scale.growth_interval", kwargs, "growth_interval", 2000, kind=int, prefix=prefix)
        d.set("loss_scale.min", 0.0, "torch GradScaler has no floor")
        d.set("loss_scale.max", float("inf"), "torch GradScaler has no cap (a non-finite grown scale is dropped)")
    else:
        d.set("loss_scale.skip_nonfinite", False, f"{prefix}enabled=False: no scaler, every step is taken")


def scaler_kwargs(policy: Policy) -> dict[str, Any]:
    """``GradScaler`` keyword arguments of the policy's loss scaling."""
    ls = policy.loss_scale
    if ls.mode != "dynamic":
        return {"enabled": False}
    return {"init_scale": ls.initial, "growth_factor": ls.growth_factor, "backoff_factor": ls.backoff_factor,
            "growth_interval": ls.growth_interval}


def from_cli(raw: Any, source: str) -> Imported:
    kw = kwargs_of(raw, source, {"GradScaler": "scaler"})
    return import_policy(source=source, **kw.get("scaler", {}))


def export_policy(policy: Policy) -> Exported:
    """``torch.amp.GradScaler`` keyword arguments for the policy's loss scaling."""
    cfg: dict[str, Any] = {"device": "cpu" if policy.ops.category("softmax") != "float32" else "cuda",
                           **scaler_kwargs(policy)}
    args = ", ".join(f"{k}={v!r}" for k, v in cfg.items())
    text = f"scaler = torch.amp.GradScaler({args})\n# with torch.autocast({cfg['device']!r}, dtype=torch.float16)\n"
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(**c))
