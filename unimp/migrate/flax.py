"""Flax: ``flax.training.dynamic_scale.DynamicScale(...)`` arguments, both directions.

Defaults read from flax/training/dynamic_scale.py: growth_factor 2.0, backoff_factor 0.5,
growth_interval 2000, fin_steps 0, scale 65536.0, minimum_scale float32 tiny; growth on the
(N+1)-th finite step, clamped at the float32 maximum; factors multiplied in float32.

>>> import_policy(growth_interval=10, scale=8.0).policy.loss_scale.growth_schedule
'interval_plus_one'
>>> export_policy(import_policy(growth_interval=10).policy).config["growth_interval"]
10
"""

from __future__ import annotations

import re
from typing import Any

from unimp.dtypes import FLT_TINY
from unimp.migrate.draft import Draft, Exported, Imported, has_knob, take
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import MAX_TEXT, kwargs_of
from unimp.migrate.values import bad, check_keys, number, refuse
from unimp.policy import Policy

SYSTEM = "flax"
KEYS = ("growth_factor", "backoff_factor", "growth_interval", "fin_steps", "scale", "minimum_scale")


def import_policy(*, source: str = "flax DynamicScale", **kwargs: Any) -> Imported:
    """The policy of ``DynamicScale(**kwargs)`` (compute and op lists: the ``mixed_fp16`` preset's)."""
    return read(kwargs, source)


def read(kwargs: dict[str, Any], source: str) -> Imported:
    """:func:`import_policy` of a table of ``DynamicScale`` arguments."""
    check_keys(kwargs, KEYS, source)
    if "fin_steps" in kwargs and number(source, "fin_steps", kwargs["fin_steps"], int) != 0:
        raise refuse(source, "fin_steps", "a non-zero counter is training state, not configuration",
                     "import with fin_steps=0 and resume the counter with amp.load_state_dict")
    d = Draft(SYSTEM, source, "flax_dynamic_scale", "flax DynamicScale rule")
    take(d, "loss_scale.initial", kwargs, "scale", 65536.0)
    take(d, "loss_scale.growth_factor", kwargs, "growth_factor", 2.0)
    take(d, "loss_scale.backoff_factor", kwargs, "backoff_factor", 0.5)
    take(d, "loss_scale.growth_interval", kwargs, "growth_interval", 2000, kind=int)
    take(d, "loss_scale.min", kwargs, "minimum_scale", FLT_TINY)
    if has_knob("loss_scale.factor_arithmetic"):
        d.set("loss_scale.factor_arithmetic", "float32", "flax multiplies in float32")
    return d.build()


HALF = re.compile(r"(?:^|[\s.])half_precision\s*=\s*(True|False)\b")


def from_cli(raw: Any, source: str) -> Imported:
    m = HALF.search(raw) if isinstance(raw, str) and len(raw) <= MAX_TEXT else None
    if m and "DynamicScale" not in raw:  # the flax examples' ml_collections config (configs/default.py)
        if m.group(1) == "False":
            d = Draft(SYSTEM, source, "fp32", "config.half_precision = False: examples/imagenet/train.py create_model "
                      "uses jnp.float32 and create_train_state builds no DynamicScale")
            d.set("loss_scale.mode", "none", "half_precision False: no DynamicScale")
            return d.build()
        raise bad(source, "half_precision", "True: the flax examples pick the dtype from the platform "
                  "(examples/imagenet/train.py create_model: jnp.bfloat16 on TPU, jnp.float16 elsewhere; "
                  "create_train_state: DynamicScale() on GPU only); import `DynamicScale()` for a GPU run, or the "
                  "preset mixed_bf16 for a TPU run")
    return read(kwargs_of(raw, source, {"DynamicScale": "scale"}, {"DynamicScale": KEYS}).get("scale", {}), source)


def export_policy(policy: Policy) -> Exported:
    """``DynamicScale`` keyword arguments for the policy's loss scaling."""
    ls = policy.loss_scale
    cfg = {"growth_factor": ls.growth_factor, "backoff_factor": ls.backoff_factor,
           "growth_interval": ls.growth_interval, "scale": ls.initial, "minimum_scale": ls.min}
    text = f"dynamic_scale = DynamicScale({', '.join(f'{k}={v!r}' for k, v in cfg.items())})\n"
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(**c))
