"""Which compute dtype runs fast where: ``auto`` resolution and slow-dtype warnings.

CPU facts come from ``unimp.hardware`` (``UNIMP_CPU_FEATURES`` simulates another CPU). Measured on
an AVX512-BF16 CPU: XLA:CPU runs a 2048² bf16 matmul slower than float32 (120 vs 73 ms) — it does
not use the bf16 units — so ``auto`` is float32 on every CPU; GPUs from compute capability 8.0
and TPUs run bf16 at full rate.

>>> resolve("auto", "cpu")[0]
'float32'
>>> resolve("bfloat16", "gpu", "8.0")[0]
'bfloat16'
"""

from __future__ import annotations

from typing import Any

from unimp.spi import hardware

XLA_CPU_WHY = ("XLA:CPU does not use them: it runs bfloat16/float16 matmuls slower than float32 (2048² "
               "matmul on AVX512-BF16: bf16 120 ms vs fp32 73 ms, measured)")


def platform_of(tree: Any = None) -> tuple[str, str | None]:
    """(platform, GPU compute capability or None) of the first array in ``tree``, else JAX's default."""
    import jax

    dev = None
    for leaf in jax.tree_util.tree_leaves(tree):
        devices = getattr(leaf, "devices", None)
        if callable(devices):
            try:
                dev = next(iter(devices()))
                break
            except Exception:
                continue
    if dev is None:
        dev = jax.devices()[0]
    return dev.platform, getattr(dev, "compute_capability", None)


def resolve(requested: str, platform: str, capability: str | None = None) -> tuple[str, str, str | None]:
    """(compute dtype, reason, warning or None) for ``requested`` on ``platform``."""
    if requested == "auto":
        if platform == "cpu":
            return (*hardware.resolve_cpu_auto("XLA:CPU", bf16=False, why_not=XLA_CPU_WHY), None)
        slow_bf16 = platform == "gpu" and capability is not None and float(capability) < 8.0
        where = f"this GPU (compute capability {capability})" if platform == "gpu" else platform
        return (*hardware.resolve_auto(fast_bf16=not slow_bf16, fast_fp16=True, where=where), None)
    warning = None
    if platform == "cpu" and requested in ("bfloat16", "float16"):
        facts = hardware.cpu()
        units = (f"this CPU, {facts.describe()}, has no native {requested} units: XLA:CPU emulates it"
                 if facts.emulated(requested) else f"XLA:CPU does not use this CPU's {requested} units")
        warning = (f"compute_dtype = {requested!r} on XLA:CPU runs slower than float32 ({units}); it runs as "
                   f"asked — use compute_dtype = 'auto' for speed (float32 on CPU)")
    return requested, "as the policy says", warning
