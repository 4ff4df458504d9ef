"""torch: ``torch.autocast(device_type, dtype)`` + ``torch.amp.GradScaler(device, init_scale,
growth_factor, backoff_factor, growth_interval, enabled)``, both directions.

Defaults read from torch/amp/grad_scaler.py (``GradScaler.__init__``: device "cuda", init_scale
2**16, growth_factor 2.0, backoff_factor 0.5, growth_interval 2000, enabled True; the deprecated
``torch.cuda.amp.GradScaler`` takes the same arguments without ``device``) and
torch/amp/autocast_mode.py (``autocast.__init__``: dtype defaults to
``torch.get_autocast_dtype(device_type)``, float16 on CUDA and bfloat16 on CPU).

Forms read: ``k=v`` lists (GradScaler's), ``GradScaler(...)`` / ``torch.amp.GradScaler("cuda", ...)``
calls, ``torch.autocast("cuda", dtype=torch.bfloat16)`` / ``with torch.autocast(...):`` lines, and
tables ``{"GradScaler": {...}, "autocast": {...}}``. A GradScaler alone means float16 autocast on
its device; an autocast alone means no GradScaler (every step taken, unscaled).

>>> imp = import_policy(init_scale=1024.0, growth_interval=100)
>>> imp.policy.loss_scale.initial, imp.policy.loss_scale.growth_interval
(1024.0, 100)
>>> export_policy(imp.policy).config["GradScaler"]["growth_interval"]
100
>>> from_cli("with torch.autocast('cuda', dtype=torch.bfloat16):", "x").policy.loss_scale.mode
'none'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.migrate.draft import Draft, Exported, Imported, take
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import kwargs_of
from unimp.migrate.values import bad, check_keys, flag, text
from unimp.policy import Policy

SYSTEM = "torch"
DEFAULTS = {"device": "cuda", "init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
            "growth_interval": 2000, "enabled": True}
AUTOCAST_KEYS = ("device_type", "dtype", "enabled", "cache_enabled")
DTYPES = {"torch.float16": "float16", "torch.half": "float16", "float16": "float16",
          "torch.bfloat16": "bfloat16", "bfloat16": "bfloat16"}
AUTOCAST_DEFAULT = {"cuda": "float16", "cpu": "bfloat16"}  # torch.get_autocast_dtype's defaults
POSITIONAL = {"GradScaler": tuple(DEFAULTS), "autocast": AUTOCAST_KEYS}
CALLS = {"GradScaler": "scaler", "autocast": "autocast"}


def import_policy(*, source: str = "torch.amp.GradScaler", **kwargs: Any) -> Imported:
    """The policy of ``torch.autocast(device, float16)`` + ``torch.amp.GradScaler(**kwargs)``."""
    return read(kwargs, None, source)


def read(scaler: Mapping[str, Any] | None, autocast: Mapping[str, Any] | None, source: str) -> Imported:
    """The policy of ``torch.autocast(**autocast)`` (None: float16 on the scaler's device) and
    ``GradScaler(**scaler)`` (None: no scaler)."""
    kw, ac = dict(scaler or {}), dict(autocast or {})
    check_keys(kw, DEFAULTS, source, "GradScaler.")
    check_keys(ac, AUTOCAST_KEYS, source, "autocast.")
    device = text(source, "GradScaler.device", kw.get("device", "cuda"), ("cuda", "cpu", "mps", "xpu", "xla", "hpu"))
    if "device_type" in ac:
        device = text(source, "autocast.device_type", ac["device_type"], ("cuda", "cpu", "mps", "xpu", "xla", "hpu"))
        if "device" in kw and kw["device"] != device:
            raise bad(source, "GradScaler.device", f"{kw['device']!s:.20} differs from autocast's {device!s:.20}; "
                                                   f"keep one device")
    if device not in ("cuda", "cpu"):
        raise bad(source, "device", f"{device[:20]!r}: unimp reproduces torch's 'cuda' and 'cpu' autocast lists")
    if "dtype" in ac:
        low = DTYPES.get(text(source, "autocast.dtype", ac["dtype"], tuple(DTYPES)))
        if low is None:
            raise bad(source, "autocast.dtype", f"{ac['dtype'][:40]!r} is not torch.float16 or torch.bfloat16")
        origin = "autocast.dtype"
    else:
        low = "float16" if scaler is not None else AUTOCAST_DEFAULT[device]
        origin = "GradScaler implies float16 autocast" if scaler is not None else \
            f"autocast dtype not given: torch's default on {device}"
    d = Draft(SYSTEM, source, extends=f"torch_autocast_{device}",
              why=f"torch.autocast('{device}') op lists" + ("" if "device" in kw or ac else " (device not given)"))
    if not flag(source, "autocast.enabled", ac.get("enabled", True)):
        d = Draft(SYSTEM, source, "fp32", "autocast(enabled=False): full precision")
        if scaler is not None:
            add_scaler(d, kw, prefix="GradScaler.")
        return d.build()
    d.set("compute_dtype", low, origin)
    if scaler is None:
        d.set("loss_scale.mode", "none", "no GradScaler given")
        d.set("loss_scale.skip_nonfinite", False, "no GradScaler: every step is taken")
        if low == "float16":
            d.note("no GradScaler given: float16 gradients are not scaled; import the GradScaler(...) line too "
                   "if the loop uses one", warn=True)
    else:
        add_scaler(d, kw, prefix="GradScaler.")
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
    if isinstance(raw, str) and ("cuda.amp." in raw or "cpu.amp." in raw):  # deprecated forms: no device argument
        device = "cpu" if "cpu.amp." in raw else "cuda"
        kw = kwargs_of(raw, source, CALLS, {"GradScaler": tuple(DEFAULTS)[1:], "autocast": AUTOCAST_KEYS[1:]})
        if "scaler" in kw:
            kw["scaler"].setdefault("device", device)
        if "autocast" in kw:
            kw["autocast"].setdefault("device_type", device)
    else:
        kw = kwargs_of(raw, source, CALLS, POSITIONAL)
    if isinstance(raw, Mapping) and not ({"GradScaler", "autocast", "scaler"} & set(raw)):
        kw = {"scaler": dict(raw)}
    return read(kw.get("scaler", {} if "autocast" not in kw else None), kw.get("autocast"), source)


def export_policy(policy: Policy) -> Exported:
    """``torch.autocast`` + ``torch.amp.GradScaler`` arguments for the policy (the device whose
    autocast op lists the policy's are closest to)."""
    device = "cpu" if policy.ops.category("softmax") != "float32" else "cuda"
    c = policy.compute_dtype
    ac: dict[str, Any] = {"device_type": device}
    if c in ("float16", "bfloat16"):
        ac["dtype"] = f"torch.{c}"
    else:
        ac["enabled"] = False
    cfg: dict[str, Any] = {"autocast": ac}
    if policy.loss_scale.mode == "dynamic":
        cfg["GradScaler"] = {"device": device, **scaler_kwargs(policy)}
    gs = cfg.get("GradScaler")
    text_ = f"with torch.autocast({', '.join(f'{k}={v}' if k == 'dtype' else f'{k}={v!r}' for k, v in ac.items())}):\n"
    text_ += "    ...\n" + (f"scaler = torch.amp.GradScaler({', '.join(f'{k}={v!r}' for k, v in gs.items())})\n"
                             if gs else "")
    return finish(SYSTEM, policy, cfg, text_, lambda cf: read(cf.get("GradScaler"), cf["autocast"], SYSTEM))
