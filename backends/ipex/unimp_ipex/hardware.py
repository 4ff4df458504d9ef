"""The CPU facts unimp-ipex decides by: the core's ``unimp.hardware`` (no framework import).

``here()`` is this CPU (or the one ``UNIMP_CPU_FEATURES`` simulates); ``resolve_auto`` and
``check`` are IPEX's rules on those facts: bfloat16 only with native bf16 units, never float16
without AVX512-FP16/AMX-FP16, and IPEX's bf16 weight prepack only where oneDNN has bf16 kernels.

>>> from unimp.hardware import LEVELS, CpuFacts
>>> avx2 = CpuFacts("x86_64", "demo", frozenset(LEVELS["avx2"]))
>>> resolve_auto(avx2)[0], bf16_prepack(avx2)
('float32', False)
"""

from __future__ import annotations

from unimp.spi import CpuFacts, cpu, resolve_cpu_auto, warn_emulated

FRAMEWORK = "IPEX (torch CPU autocast)"


def here() -> CpuFacts:
    """This CPU's facts (or the simulated CPU's)."""
    return cpu()


def resolve_auto(facts: CpuFacts) -> tuple[str, str]:
    """``auto`` on this CPU: bfloat16 with native bf16 units, else float32 (never float16 on CPU)."""
    return resolve_cpu_auto(FRAMEWORK, facts)


def bf16_prepack(facts: CpuFacts) -> bool:
    """Whether ``ipex.optimize(dtype=bfloat16, weights_prepack=True)`` can run here.

    IPEX asserts AVX-NE-CONVERT or AVX512 BW/VL/DQ (its ``onednn_has_bf16_support``) and fails otherwise.
    """
    return facts.bf16_kernels


def check(facts: CpuFacts, dtype: str, key: str) -> str | None:
    """Warn for emulated bf16 (returns the message); refuse float16 without AVX512-FP16/AMX-FP16."""
    from unimp.spi import UnsupportedError

    if dtype == "float16" and not facts.native_fp16:
        raise UnsupportedError(f"{key} = 'float16': this CPU, {facts.describe()}, has no AVX512-FP16/AMX-FP16, "
                               f"so float16 is emulated and slower than float32; use 'bfloat16' or 'auto', or "
                               f"backend='torch' to run emulated float16")
    return warn_emulated(dtype, key, FRAMEWORK, facts)
