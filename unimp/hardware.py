"""Hardware facts that decide ``compute_dtype = "auto"`` — read without importing a framework.

>>> resolve_auto(fast_bf16=False, fast_fp16=False, where="XLA:CPU")
('float32', 'auto: XLA:CPU has no fast bfloat16 or float16, float32 is fastest')
>>> resolve_auto(fast_bf16=True, fast_fp16=True, where="cuda")
('bfloat16', 'auto: cuda runs bfloat16 fast')
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matmuls beat fp32 on this CPU (x86 only)."""
    return platform.machine() in ("x86_64", "AMD64") and any(f in cpu_flags() for f in BF16_FLAGS)


def cpu_has_fast_fp16() -> bool:
    """AVX512-FP16 or AMX-FP16 (Sapphire Rapids and later)."""
    return platform.machine() in ("x86_64", "AMD64") and any(f in cpu_flags() for f in FP16_FLAGS)


def resolve_auto(*, fast_bf16: bool, fast_fp16: bool, where: str) -> tuple[str, str]:
    """``auto``: bf16 where it is fast, else fp16 (+ dynamic loss scaling), else float32; with the reason."""
    if fast_bf16:
        return "bfloat16", f"auto: {where} runs bfloat16 fast"
    if fast_fp16:
        return "float16", f"auto: {where} has fast float16 but no fast bfloat16 (dynamic loss scaling on)"
    return "float32", f"auto: {where} has no fast bfloat16 or float16, float32 is fastest"
