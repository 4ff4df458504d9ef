"""Lightning: ``Trainer(precision=...)`` / ``Fabric(precision=...)`` strings, both directions.

Read from lightning/fabric/plugins/precision (precision.py, amp.py, half.py): "32-true" (aliases
"32", 32) full precision; "16-mixed" ("16", 16) ``torch.autocast`` float16 + ``torch.amp.GradScaler()``
defaults; "bf16-mixed" ("bf16") autocast bfloat16 without a scaler; "16-true" / "bf16-true" the
whole model (parameters and every op) in that dtype, no scaler, no master weights; "64-true" and
"transformer-engine(-float16)" (fp8) have no unimp equivalent.

>>> import_policy("bf16-true").policy.param_dtype
'bfloat16'
>>> export_policy(import_policy("16-mixed").policy).config
'16-mixed'
"""

from __future__ import annotations

from typing import Any

from ..policy import Policy
from . import torch as torch_amp
from .common import Draft, Exported, Imported, bad, finish, refuse, short

SYSTEM = "lightning"
ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "transformer-engine",
              "transformer-engine-float16")


def import_policy(precision: str | int = "32-true", *, source: str = "lightning") -> Imported:
    """The policy of ``Trainer(precision=precision)``."""
    name = ALIASES.get(str(precision), str(precision))
    if name not in PRECISIONS:
        raise bad(source, "precision",
                  f"{short(precision)} is not one of {', '.join(PRECISIONS)} (or 64, 32, 16, 'bf16')")
    if name == "64-true":
        raise refuse(source, "precision", "'64-true' trains in float64, which unimp policies do not hold",
                     "use '32-true' (policy fp32)")
    if name.startswith("transformer-engine"):
        raise refuse(source, "precision", f"{name!r} runs Transformer Engine fp8 layers, which unimp has no dtype "
                     f"for", "import 'bf16-mixed' and keep Transformer Engine for the fp8 layers")
    where = f"precision={precision!r}"
    if name == "32-true":
        return Draft(SYSTEM, source, "fp32", f"{where}: full precision").build()
    low = "float16" if name.startswith("16") else "bfloat16"
    if name.endswith("-mixed"):
        d = Draft(SYSTEM, source, "torch_autocast_cuda", f"{where}: torch.autocast (CUDA op lists)")
        d.set("compute_dtype", low, where)
        if low == "float16":
            torch_amp.add_scaler(d, {}, prefix="GradScaler().")
        else:
            d.set("loss_scale.mode", "none", f"{where}: no GradScaler")
            d.set("loss_scale.skip_nonfinite", False, f"{where}: every step is taken")
        return d.build()
    d = Draft(SYSTEM, source, "fp32", f"{where}: the model converted to {low}")
    d.set("compute_dtype", low, where)
    d.set("param_dtype", low, f"{where}: parameters converted")
    d.set("output_dtype", low, f"{where}: outputs in {low}")
    d.set("ops.float32", [], f"{where}: every op runs in {low}")
    d.set("master_weights.enabled", False, f"{where}: no float32 copy")
    return d.build()


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, dict):
        return import_policy(raw.get("precision", "32-true"), source=source)
    text = str(raw).strip()
    text = text.split("=", 1)[1].strip() if text.startswith("precision") else text
    return import_policy(text.strip("'\""), source=source)


def export_policy(policy: Policy) -> Exported:
    """The ``precision`` string closest to the policy."""
    c, p = policy.compute_dtype, policy.param_dtype
    if c == "float32":
        name = "32-true"
    elif p == "float32":
        name = "16-mixed" if c == "float16" else "bf16-mixed"
    else:
        name = "16-true" if p == "float16" else "bf16-true"
    return finish(SYSTEM, policy, name, f"trainer = Trainer(precision={name!r})\n", import_policy)
