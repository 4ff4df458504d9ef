"""The CPU facts unimp-ipex decides by: the core's ``hardware`` (no framework import).

``resolve_auto`` and ``check`` are IPEX's rules on the facts of ``hardware.cpu()`` (or of the CPU
``UNIMP_CPU_FEATURES`` simulates): bfloat16 only with native bf16 units, never float16 without
AVX512-FP16/AMX-FP16, and IPEX's bf16 weight prepack only where oneDNN has bf16 kernels.

>>> from unimp.spi import hardware
>>> avx2 = hardware.CpuFacts("x86_64", "demo", frozenset(hardware.LEVELS["avx2"]))
>>> resolve_auto(avx2)[0], bf16_prepack(avx2)
('float32', False)
"""

from __future__ import annotations

from unimp.spi import hardware

FRAMEWORK = "IPEX (torch CPU autocast)"


def resolve_auto(facts: hardware.CpuFacts) -> tuple[str, str]:
    """``auto`` on this CPU: bfloat16 with native bf16 units, else float32 (never float16 on CPU)."""
    return hardware.resolve_cpu_auto(FRAMEWORK, facts)


def bf16_prepack(facts: hardware.CpuFacts) -> bool:
    """Whether ``ipex.optimize(dtype=bfloat16, weights_prepack=True)`` can run here.

    IPEX asserts AVX-NE-CONVERT or AVX512 BW/VL/DQ (its ``onednn_has_bf16_support``) and fails otherwise.
    """
    return facts.bf16_kernels


def check(facts: hardware.CpuFacts, dtype: str, key: str) -> str | None:
    """Warn for emulated bf16 (returns the message); refuse float16 without AVX512-FP16/AMX-FP16."""
    from unimp.spi import UnsupportedError

    if dtype == "float16" and not facts.native_fp16:
        raise UnsupportedError(f"{key} = 'float16': this CPU, {facts.describe()}, has no AVX512-FP16/AMX-FP16, "
                               f"so float16 is emulated and slower than float32; use 'bfloat16' or 'auto', or "
                               f"backend='torch' to run emulated float16")
    return hardware.warn_emulated(dtype, key, FRAMEWORK, facts)
