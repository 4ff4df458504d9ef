"""How ``ipex.optimize`` is called for a policy and a model: IPEX's bf16 weights, or float32.

IPEX's bf16 path (``dtype=torch.bfloat16``) makes Linear/Conv/Embedding weights bf16 (prepacked
for oneDNN) and keeps fp32 masters in its optimizer. unimp takes it only when that is exactly what
the policy asks for every layer and there is no loss scaling (IPEX's master step re-reads the
bf16 grads, so nothing can unscale or skip in between). Otherwise IPEX runs float32 weights and
unimp-torch does params, masters and scaling; weight prepacking then stays off under autocast
(measured: IPEX 2.8 fp32-prepacked Conv2d + bf16 autocast aborts in backward with heap corruption).
IPEX's bf16 weights are prepacked only where its oneDNN has bf16 kernels (AVX512 BW/VL/DQ or
AVX-NE-CONVERT, from the core's ``hardware``): elsewhere ``ipex.optimize`` asserts, so they stay unpacked.

>>> import torch, unimp
>>> from unimp.spi import Plan, hardware
>>> from unimp_ipex.engine import Engine
>>> from unimp_ipex.plan import compile_plan
>>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> avx2, zen4 = (hardware.CpuFacts("x86_64", "demo", frozenset(hardware.LEVELS[c]))
...               for c in ("avx2", "avx512_bf16"))
>>> plan = lambda name: compile_plan(Plan.request(unimp.load(name), "ipex"), m, Engine("torch", "demo"), zen4)
>>> [(mode.dtype, mode.weights_prepack) for mode in (choose(plan("pure_bf16"), m, cpu) for cpu in (zen4, avx2))]
[('bfloat16', True), ('bfloat16', False)]
>>> choose(plan("mixed_bf16"), m, zen4).weights_prepack
False
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from unimp.spi import Plan, hardware
from unimp_torch.extension import kind, type_names

# the layer types IPEX 2.8 casts to bf16 under ipex.optimize(dtype=torch.bfloat16): exact types,
# subclasses are left float32 (measured; see README). Other layers the policy wants in bf16 get
# unimp-torch's params and masters next to IPEX's.
BF16_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)


@dataclass(frozen=True)
class IpexSettings:
    """How ``ipex.optimize`` is called (``plan.details.ipex``), and why."""

    version: str | None
    dtype: str  # "bfloat16" (IPEX bf16 weights + IPEX masters) | "float32"
    weights_prepack: bool
    reason: str

    def kwargs(self) -> dict:
        import torch

        kw = {"dtype": getattr(torch, self.dtype), "weights_prepack": self.weights_prepack, "inplace": False}
        if self.dtype == "bfloat16":
            kw["split_master_weight_for_bf16"] = False  # True gives truncated bf16, not round-to-nearest
        return kw


def _layer_conflicts(plan: Plan, model: nn.Module | None) -> list[str]:
    """Layers whose policy dtypes differ from what IPEX's bf16 path gives them."""
    if model is None:
        return []
    out = []
    for path, m in model.named_modules():
        if type(m) not in BF16_LAYERS or not any(True for _ in m.parameters(recurse=False)):
            continue
        d, name = plan.decide(path, kind(m), type_names(m)), path or "<model>"
        if d.param_dtype != "bfloat16" or d.compute_dtype not in (None, "bfloat16") or d.sets_compute:
            out.append(f"{name} ({type(m).__name__}): policy asks params {d.param_dtype}, compute "
                       f"{d.compute_dtype or 'inputs'}; IPEX would make it bf16")
    return out


def choose(plan: Plan, model: nn.Module | None, cpu: hardware.CpuFacts, version: str | None = None) -> IpexSettings:
    """The IPEX mode (of IPEX ``version``) for the CPU ``plan`` (its resolved compute dtype, loss scale and
    per-layer decisions) on ``model`` (None: not known yet) and ``cpu``."""
    autocast = plan.details.autocast is not None  # the compute dtype or an override's is low (unimp-torch's Plan)
    fp32 = "float32 weights; " + ("prepacking off: IPEX 2.8 fp32-prepacked convolutions abort in backward under "
                                  "bf16 autocast" if autocast else "oneDNN weight prepacking on")
    ls, why = plan.loss_scale, None
    if plan.compute_dtype != "bfloat16" or plan.param_dtype != "bfloat16":
        why = fp32
    elif ls.mode != "none" or ls.skip_nonfinite:
        why = ("IPEX's bf16 master-weight step cannot be unscaled or skipped; loss scaling runs in unimp-torch "
               "with its masters; " + fp32)
    elif conflicts := _layer_conflicts(plan, model):
        why = f"IPEX's bf16 weights do not fit this policy ({'; '.join(conflicts)}); masters in unimp-torch; {fp32}"
    if why is not None:
        return IpexSettings(version, "float32", not autocast, why)
    masters = "with its fp32 master weights (split_master_weight_for_bf16=False: round-to-nearest bf16 copies)"
    from .hardware import bf16_prepack

    if not bf16_prepack(cpu):
        return IpexSettings(version, "bfloat16", False, f"IPEX bf16 weights, not prepacked: IPEX's bf16 weight "
                            f"prepack needs AVX512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks "
                            f"({cpu.describe()}); {masters}")
    return IpexSettings(version, "bfloat16", True, "IPEX bf16 weights (prepacked Linear/Conv2d) " + masters)
