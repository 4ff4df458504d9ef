"""What this CPU does fast, from its feature flags (no framework import).

>>> cpu = CpuFeatures(frozenset({"avx512_bf16"}))
>>> cpu.fast_bf16, cpu.describe()
(True, 'AVX512-BF16')
>>> CpuFeatures(frozenset()).resolve_auto()[0]
'float32'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from unimp import hardware
from unimp.backend import UnimpWarning

NAMES = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16", "amx_fp16": "AMX-FP16",
         "avx512_fp16": "AVX512-FP16"}


@dataclass(frozen=True)
class CpuFeatures:
    """The low-precision feature flags of one CPU (``/proc/cpuinfo`` names)."""

    flags: frozenset[str]

    @classmethod
    def here(cls) -> CpuFeatures:
        return cls(frozenset(f for f in hardware.cpu_flags() if f in NAMES))

    @property
    def fast_bf16(self) -> bool:
        return any(f in self.flags for f in hardware.BF16_FLAGS)

    @property
    def fast_fp16(self) -> bool:
        return any(f in self.flags for f in hardware.FP16_FLAGS)

    def describe(self) -> str:
        found = [n for f, n in NAMES.items() if f in self.flags]
        return ", ".join(found) or "no AVX512-BF16/AMX/AVX512-FP16"

    def resolve_auto(self) -> tuple[str, str]:
        """``auto`` on this CPU: bfloat16 where it is fast, else float32 (never float16 on CPU)."""
        return hardware.resolve_auto(fast_bf16=self.fast_bf16, fast_fp16=False,
                                     where=f"this CPU ({self.describe()})")

    def check(self, dtype: str, key: str) -> None:
        """Warn for bf16 without AVX512-BF16/AMX; refuse fp16 without AVX512-FP16/AMX-FP16."""
        from unimp.errors import UnsupportedError

        if dtype == "bfloat16" and not self.fast_bf16:
            warnings.warn(f"unimp-ipex: {key} = 'bfloat16' on a CPU without AVX512-BF16/AMX "
                          f"({self.describe()}): bfloat16 is emulated there and slower than float32; "
                          f"set compute_dtype = 'auto' to run float32 on such CPUs", UnimpWarning, stacklevel=5)
        if dtype == "float16" and not self.fast_fp16:
            raise UnsupportedError(f"{key} = 'float16': this CPU ({self.describe()}) has no AVX512-FP16/"
                                   f"AMX-FP16, so float16 is emulated and slower than float32; use "
                                   f"'bfloat16' or 'auto', or backend='torch' to run emulated float16")
