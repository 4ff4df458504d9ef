"""Hardware facts that decide ``compute_dtype = "auto"`` — one source, read without importing a framework.

``cpu()`` is what this CPU (or the simulated one) can do for low precision: its architecture,
model name and the feature flags that matter (x86 ``/proc/cpuinfo`` names such as ``avx512_bf16``,
``amx_bf16``, ``avx512_fp16``, ``avx_ne_convert``, ``avx512bw``; arm64 ``Features`` such as ``bf16``,
``fphp``/``asimdhp``). ``resolve_cpu_auto`` turns those facts into the ``auto`` compute dtype of a
framework, with the reason every backend writes into its Plan; ``emulated`` says when an explicit
``bfloat16``/``float16`` runs without native units (slower than float32).

Simulating a smaller machine
----------------------------
``UNIMP_CPU_FEATURES`` replaces the facts read from the CPU with a subset of them. Grammar (tokens
separated by commas or spaces, applied left to right)::

    UNIMP_CPU_FEATURES = token ("," token)*
    token = LEVEL          the feature set of a CPU class (sets the architecture), see LEVELS
          | "host"         the features of the real CPU
          | FLAG           add one feature flag (a /proc/cpuinfo name, e.g. avx512_bf16)
          | "-" FLAG       remove one feature flag (a spec that starts with one starts from "host")

e.g. ``avx2`` (an AVX2-only x86-64 CPU), ``avx512`` (AVX512 without BF16), ``avx512_bf16``,
``host,-avx512_bf16``, ``-amx_bf16``. A simulation can only take features away (a framework cannot
run instructions the CPU lacks): a flag the real CPU lacks, a CPU class whose low-precision units
(what :meth:`CpuFacts.describe` names) it lacks, or another architecture is a :class:`PolicyError`
naming the token; a class's minor flags the CPU lacks (e.g. ``avx512_vnni`` on Skylake-SP) are
left out. Frameworks only see the simulation through their
own variables: ``simulated_env("avx2")`` gives ``UNIMP_CPU_FEATURES`` plus ``ONEDNN_MAX_CPU_ISA``
(oneDNN in torch, IPEX and Paddle), ``ATEN_CPU_CAPABILITY`` (torch's vectorised kernels) and
``XLA_FLAGS=--xla_cpu_max_isa`` (JAX/XLA:CPU), all derived from the same facts :func:`cpu` reports
in the child. TensorFlow decides from its own CPUID check whether
to use oneDNN's bf16 kernels and aborts the process when oneDNN is capped below them, so for a
CPU without them the simulation also sets ``TF_ENABLE_ONEDNN_OPTS=0`` (TF then runs its Eigen
kernels, as it does for bf16 on such a CPU). Launch a process under it with
``python -m unimp.hardware --simulate avx2 -- COMMAND``; ``python -m unimp.hardware`` prints the facts.

>>> facts = CpuFacts("x86_64", "demo", frozenset(LEVELS["avx2"]))
>>> facts.native_bf16, facts.bf16_kernels, facts.describe()
(False, False, 'demo (x86_64: AVX2; no AVX512, no AVX512-BF16/AMX-BF16, no AVX512-FP16/AMX-FP16)')
>>> resolve_cpu_auto("torch", facts)[0]
'float32'
>>> zen4 = CpuFacts("x86_64", "demo", frozenset(LEVELS["avx512_bf16"]))
>>> parse_features("avx512,avx512_bf16,-avx512dq", host=zen4)[1] >= {"avx512_bf16", "avx512bw"}
True
>>> parse_features("amx", host=zen4)
Traceback (most recent call last):
unimp.errors.PolicyError: UNIMP_CPU_FEATURES='amx': 'amx' asks for amx_bf16, ... which this CPU lacks ...
>>> simulated_env("avx2", base={}, host=zen4)["ONEDNN_MAX_CPU_ISA"]
'AVX2'
>>> resolve_auto(fast_bf16=True, fast_fp16=True, where="cuda")
('bfloat16', 'auto: cuda runs bfloat16 fast')
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from unimp.errors import PolicyError, UnimpWarning

ENV = "UNIMP_CPU_FEATURES"
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_FLAGS = ("avx512_fp16", "amx_fp16")
AVX512_CORE = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
ARM_BF16 = ("bf16",)
ARM_FP16 = ("fphp", "asimdhp")
# the flags unimp reads (others in /proc/cpuinfo are kept out of the facts and the reports)
RELEVANT = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx_ne_convert", *AVX512_CORE,
                      "avx512cd", "avx512_vnni", *BF16_FLAGS, *FP16_FLAGS, "amx_tile", "amx_int8",
                      "asimd", "sve", "sve2", "i8mm", *ARM_BF16, *ARM_FP16})

_AVX2 = ("sse4_2", "avx", "avx2", "fma", "f16c")
_AVX512 = (*_AVX2, *AVX512_CORE, "avx512cd", "avx512_vnni")
_AMX = (*_AVX512, "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# CPU classes for UNIMP_CPU_FEATURES: (architecture, flags)
LEVELS: dict[str, tuple[str, ...]] = {
    "x86-64": ("sse4_2",),
    "avx2": _AVX2,  # Haswell..Comet Lake, AMD Zen 1-3, most laptops and CI runners
    "avx2_ne_convert": (*_AVX2, "avx_vnni", "avx_ne_convert"),  # Sierra Forest / Arrow Lake: bf16 convert, no AVX512
    "avx512": _AVX512,  # Skylake-SP..Ice Lake: AVX512 without BF16
    "avx512_bf16": (*_AVX512, "avx512_bf16"),  # Cooper Lake, AMD Zen 4/5
    "amx": _AMX,  # Sapphire/Emerald Rapids
    "amx_fp16": (*_AMX, "avx512_fp16", "amx_fp16"),  # Granite Rapids
    "arm64": ("asimd",),  # Neoverse N1 / Graviton2 without fp16 arithmetic
    "arm64_fp16": ("asimd", *ARM_FP16),
    "arm64_bf16": ("asimd", *ARM_FP16, "i8mm", *ARM_BF16),  # Graviton3, Neoverse V1/N2
}
ARM_LEVELS = ("arm64", "arm64_fp16", "arm64_bf16")
# measured: torch CPU bf16 autocast vs float32 step time without native bf16 units
EMULATED_FACTOR = ("measured: the README demo ran bfloat16 at 0.38x the speed of float32 on an AVX2-only "
                   "AMD EPYC (3154 vs 1207 ms/step, torch)")


def _arch(machine: str) -> str:
    m = machine.lower()
    return {"amd64": "x86_64", "x64": "x86_64", "aarch64": "arm64"}.get(m, m)


@dataclass(frozen=True)
class CpuFacts:
    """What one CPU can do for low precision: ``arch`` (x86_64 | arm64 | ...), model, feature flags.

    ``simulated`` is the ``UNIMP_CPU_FEATURES`` value the facts come from (None: the real CPU).
    """

    arch: str
    model: str
    features: frozenset[str]
    simulated: str | None = None

    @property
    def x86(self) -> bool:
        return self.arch == "x86_64"

    @property
    def avx512_core(self) -> bool:
        """AVX512 F/BW/VL/DQ: oneDNN's ``avx512_core`` (it emulates bf16 kernels from here up)."""
        return self.x86 and all(f in self.features for f in AVX512_CORE)

    @property
    def native_bf16(self) -> bool:
        """bf16 dot-product units: AVX512-BF16 / AMX-BF16 (x86), BF16 (arm64 BFMMLA/BFDOT)."""
        flags = BF16_FLAGS if self.x86 else ARM_BF16 if self.arch == "arm64" else ()
        return any(f in self.features for f in flags)

    @property
    def native_fp16(self) -> bool:
        """fp16 arithmetic units: AVX512-FP16 / AMX-FP16 (x86), FPHP+ASIMDHP (arm64)."""
        if self.x86:
            return any(f in self.features for f in FP16_FLAGS)
        return self.arch == "arm64" and all(f in self.features for f in ARM_FP16)

    @property
    def bf16_kernels(self) -> bool:
        """Whether oneDNN has bf16 matmul/conv kernels here at all (native or emulated).

        x86: AVX512 F/BW/VL/DQ or AVX-NE-CONVERT — what IPEX's bf16 weight prepack and Paddle's
        static bf16 matmul need; without them those frameworks fail instead of running slowly.
        """
        if self.x86:
            return self.avx512_core or "avx_ne_convert" in self.features or self.native_bf16
        return self.native_bf16

    def emulated(self, dtype: str) -> bool:
        """Whether ``dtype`` (bfloat16/float16) runs without native units on this CPU."""
        return (dtype == "bfloat16" and not self.native_bf16) or (dtype == "float16" and not self.native_fp16)

    def describe(self) -> str:
        """One line: model, architecture, the features that decide low precision."""
        f = self.features
        if self.x86:
            isa = ("AVX512" if self.avx512_core else "AVX2" if "avx2" in f else "AVX" if "avx" in f else "SSE")
            have = [isa] + [n for flag, n in (("avx_ne_convert", "AVX-NE-CONVERT"), ("avx512_bf16", "AVX512-BF16"),
                                              ("amx_bf16", "AMX-BF16"), ("avx512_fp16", "AVX512-FP16"),
                                              ("amx_fp16", "AMX-FP16")) if flag in f]
            lack = [n for ok, n in ((self.avx512_core, "AVX512"), (self.native_bf16, "AVX512-BF16/AMX-BF16"),
                                    (self.native_fp16, "AVX512-FP16/AMX-FP16")) if not ok]
            lack += ["AMX"] if self.native_bf16 and "amx_bf16" not in f else []
        else:
            have = [n for flag, n in (("asimd", "NEON"), ("sve", "SVE"), ("bf16", "BF16"),
                                      ("asimdhp", "FP16")) if flag in f] or ["no NEON"]
            lack = [n for ok, n in ((self.native_bf16, "BF16"), (self.native_fp16, "FP16")) if not ok]
        text = f"{self.model} ({self.arch}: {', '.join(have)}"
        text += f"; no {', no '.join(lack)})" if lack else ")"
        if self.simulated is not None:
            text += f" [simulated: {ENV}={self.simulated}]"
        return text

    def record(self) -> dict[str, Any]:
        """The facts as plain data (for Plans, reports and the conformance matrix)."""
        return {"arch": self.arch, "model": self.model, "features": sorted(self.features),
                "simulated": self.simulated, "native_bf16": self.native_bf16, "native_fp16": self.native_fp16,
                "describe": self.describe()}


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, all flags) from ``/proc/cpuinfo`` (x86 ``flags``, arm64 ``Features``); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU", frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "Hardware") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model or platform.processor() or "unknown CPU", flags


def host() -> CpuFacts:
    """The real CPU, whatever ``UNIMP_CPU_FEATURES`` says."""
    model, flags = _cpuinfo()
    return CpuFacts(_arch(platform.machine()), model, flags & RELEVANT)


MAX_SPEC_CHARS = 1024


def parse_features(spec: str, *, host: CpuFacts) -> tuple[str, frozenset[str]]:
    """(architecture, features) for an ``UNIMP_CPU_FEATURES`` value: a subset of ``host``'s.

    PolicyError names a bad token, an empty spec, or a token that asks for more than ``host`` has.
    """
    where = f"{ENV}={spec[:60]!r}{'...' if len(spec) > 60 else ''}"
    if len(spec) > MAX_SPEC_CHARS:
        raise PolicyError(f"{where}: longer than {MAX_SPEC_CHARS} characters; name a CPU class such as avx2")
    tokens = spec.replace(",", " ").split()
    if not tokens:
        raise PolicyError(f"{where}: empty; name a CPU class ({', '.join(LEVELS)}) or 'host' "
                          f"(leave the variable unset for the real CPU)")
    lacks = f"which this CPU lacks ({host.describe()}); a simulation can only take features away"
    arch, flags = host.arch, set(host.features) if tokens[0].startswith("-") else set()
    for token in tokens:
        name = token.lower()
        if name == "host":
            arch, flags = host.arch, set(host.features)
        elif name in LEVELS:
            level_arch = "arm64" if name in ARM_LEVELS else "x86_64"
            if level_arch != host.arch:
                raise PolicyError(f"{where}: {token!r} is an {level_arch} CPU class and this CPU is {host.arch}; "
                                  f"a simulation can only take features away")
            level = frozenset(LEVELS[name])
            kept = level & host.features  # minor flags the host lacks are left out, units must all be there
            if CpuFacts(level_arch, "", kept).describe() != CpuFacts(level_arch, "", level).describe():
                raise PolicyError(f"{where}: {token!r} asks for {', '.join(sorted(level - kept))}, {lacks}")
            arch, flags = level_arch, flags | kept
        elif name.startswith("-") and name[1:] in RELEVANT:
            flags.discard(name[1:])
        elif name in RELEVANT:
            if name not in host.features:
                raise PolicyError(f"{where}: {token!r} asks for {name}, {lacks}")
            flags.add(name)
        else:
            raise PolicyError(f"{where}: unknown token {token[:40]!r}; use a CPU class "
                              f"({', '.join(LEVELS)}), 'host', or a feature flag ({', '.join(sorted(RELEVANT))}) "
                              f"with an optional leading '-' to remove it")
    return arch, frozenset(flags)


def cpu() -> CpuFacts:
    """This CPU's facts, or the simulated CPU's when ``UNIMP_CPU_FEATURES`` is set (non-empty)."""
    spec = os.environ.get(ENV, "")
    return simulated(spec) if spec.strip() else host()


def simulated(spec: str, real: CpuFacts | None = None) -> CpuFacts:
    """The facts a simulation ``spec`` leaves of ``real`` (default: this CPU) — what :func:`cpu` reports."""
    return _simulated(spec, real or host())


@functools.lru_cache(maxsize=8)
def _simulated(spec: str, real: CpuFacts) -> CpuFacts:
    arch, flags = parse_features(spec, host=real)
    return CpuFacts(arch, real.model, flags, simulated=spec)


def onednn_isa(facts: CpuFacts) -> str | None:
    """The ``ONEDNN_MAX_CPU_ISA`` value that makes oneDNN behave like ``facts`` (x86 only)."""
    if not facts.x86:
        return None
    f = facts.features
    for flags, isa in ((("amx_fp16",), "AVX512_CORE_AMX_FP16"), (("amx_bf16",), "AVX512_CORE_AMX"),
                       (("avx512_fp16",), "AVX512_CORE_FP16"), (("avx512_bf16",), "AVX512_CORE_BF16"),
                       (("avx512_vnni",), "AVX512_CORE_VNNI")):
        if facts.avx512_core and all(x in f for x in flags):
            return isa
    if facts.avx512_core:
        return "AVX512_CORE"
    if "avx_ne_convert" in f:
        return "AVX2_VNNI_2"
    if "avx_vnni" in f:
        return "AVX2_VNNI"
    return "AVX2" if "avx2" in f else "AVX" if "avx" in f else "SSE41"


def simulated_env(spec: str, base: Mapping[str, str] | None = None, *, host: CpuFacts | None = None
                  ) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus the variables that make unimp and the frameworks see ``spec``.

    The frameworks' caps come from the same facts :func:`cpu` reports under ``spec`` (on ``host``,
    default this CPU), so they always agree.

    >>> zen4 = CpuFacts("x86_64", "demo", frozenset(LEVELS["avx512_bf16"]))
    >>> env = simulated_env("avx2", base={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, host=zen4)
    >>> env["ATEN_CPU_CAPABILITY"], env["XLA_FLAGS"]
    ('avx2', '--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2')
    """
    env = dict(os.environ if base is None else base)
    facts = simulated(spec, host)
    env[ENV] = spec
    isa = onednn_isa(facts)
    if isa is not None:
        flags = facts.features
        env["ONEDNN_MAX_CPU_ISA"] = env["DNNL_MAX_CPU_ISA"] = isa
        env["ATEN_CPU_CAPABILITY"] = "avx512" if facts.avx512_core else "avx2" if "avx2" in flags else "default"
        if not facts.bf16_kernels:  # TF checks CPUID itself, then oneDNN refuses: terminate() (measured)
            env["TF_ENABLE_ONEDNN_OPTS"] = "0"
        xla = "AVX512" if facts.avx512_core else "AVX2" if "avx2" in flags else "SSE4_2"
        kept = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_cpu_max_isa=")]
        env["XLA_FLAGS"] = " ".join([*kept, f"--xla_cpu_max_isa={xla}"])
    return env


def resolve_auto(*, fast_bf16: bool, fast_fp16: bool, where: str) -> tuple[str, str]:
    """``auto``: bf16 where it is fast, else fp16 (+ dynamic loss scaling), else float32; with the reason."""
    if fast_bf16:
        return "bfloat16", f"auto: {where} runs bfloat16 fast"
    if fast_fp16:
        return "float16", f"auto: {where} has fast float16 but no fast bfloat16 (dynamic loss scaling on)"
    return "float32", f"auto: {where} has no fast bfloat16 or float16, float32 is fastest"


def resolve_cpu_auto(framework: str, facts: CpuFacts | None = None, *, bf16: bool = True, fp16: bool = False,
                     why_not: str = "") -> tuple[str, str]:
    """``auto`` for ``framework`` on this CPU: bf16 only with native bf16 units, fp16 only with fp16 units.

    ``bf16``/``fp16``: whether the framework's CPU kernels use those units at all (``why_not``
    says why not, e.g. a measurement); float16 on CPU also needs loss scaling, so backends opt in.

    >>> resolve_cpu_auto("XLA:CPU", CpuFacts("x86_64", "demo", frozenset(LEVELS["amx"])), bf16=False,
    ...                  why_not="XLA:CPU does not use them")[0]
    'float32'
    """
    facts = facts or cpu()
    where = f"this CPU, {facts.describe()},"
    if facts.native_bf16 and bf16:
        return "bfloat16", f"auto: {where} has native bfloat16 units that {framework} uses"
    if facts.native_fp16 and fp16:
        return "float16", (f"auto: {where} has native float16 but no bfloat16 units that {framework} uses; "
                           f"float16 with dynamic loss scaling")
    if facts.native_bf16 or (facts.native_fp16 and fp16):
        return "float32", f"auto: {where} has bfloat16 units but {why_not or framework + ' does not use them'}: float32"
    return "float32", (f"auto: {where} has no native bfloat16/float16 units: {framework} would emulate "
                       f"them, slower than float32 ({EMULATED_FACTOR}): float32")


def emulated_message(dtype: str, key: str, framework: str, facts: CpuFacts | None = None) -> str | None:
    """The warning for an explicit ``dtype`` that runs emulated here, or None when it has native units."""
    facts = facts or cpu()
    if dtype not in ("bfloat16", "float16") or not facts.emulated(dtype):
        return None
    factor = f" ({EMULATED_FACTOR})" if dtype == "bfloat16" else ""
    return (f"{key} = {dtype!r} on this CPU, {facts.describe()}: it has no native {dtype} units, so "
            f"{framework} emulates {dtype} and runs slower than float32{factor}. It runs as asked; set "
            f"compute_dtype = \"auto\" to run the fastest dtype here (float32)")


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside unimp and its backends."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name == "unimp" or name.startswith(("unimp.", "unimp_"))):
            return level
        frame, level = frame.f_back, level + 1
    return level


def warn_emulated(dtype: str, key: str, framework: str, facts: CpuFacts | None = None) -> str | None:
    """Warn (located at the user's call) when ``dtype`` is emulated here; returns the message or None."""
    msg = emulated_message(dtype, key, framework, facts)
    if msg is not None:
        warnings.warn(f"unimp: {msg}", UnimpWarning, stacklevel=caller_stacklevel())
    return msg


# --------------------------------------------------------------------- compatibility (older callers)
def cpu_flags() -> frozenset[str]:
    """The feature flags of this (or the simulated) CPU."""
    return cpu().features


def cpu_has_fast_bf16() -> bool:
    return cpu().native_bf16


def cpu_has_fast_fp16() -> bool:
    return cpu().native_fp16


USAGE = "usage: python -m unimp.hardware [--simulate SPEC [-- COMMAND ...]]"


def main(argv: list[str] | None = None) -> int:
    """``python -m unimp.hardware [--simulate SPEC -- COMMAND...]``: print the facts, or run COMMAND simulated.

    A bad SPEC (or ``UNIMP_CPU_FEATURES``) exits 2 and a COMMAND that cannot start 127, each with one line.
    """
    import subprocess

    args = list(sys.argv[1:] if argv is None else argv)
    prog = "python -m unimp.hardware"
    try:
        if args[:1] == ["--simulate"]:
            if len(args) < 2 or args[1] == "--":
                print(f"{prog}: --simulate needs a SPEC (a CPU class such as avx2, or host,-FLAG)\n{USAGE}",
                      file=sys.stderr)
                return 2
            spec, rest = args[1], args[2:]
            rest = rest[1:] if rest[:1] == ["--"] else rest
            env = simulated_env(spec)
            if not rest:
                for k in (ENV, "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "XLA_FLAGS",
                          "TF_ENABLE_ONEDNN_OPTS"):
                    if k in env:
                        print(f"{k}={env[k]}")
                return 0
            try:
                return subprocess.call(rest, env=env)
            except OSError as e:
                print(f"{prog} --simulate {spec}: cannot run {rest[0][:200]!r}: {e.strerror or e}", file=sys.stderr)
                return 127
        if args:
            print(USAGE, file=sys.stderr)
            return 2
        facts = cpu()
    except PolicyError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    print(facts.describe())
    print("features:", " ".join(sorted(facts.features)) or "(none read)")
    for fw, bf16 in (("torch", True), ("XLA:CPU", False)):
        print(f"auto ({fw}):", resolve_cpu_auto(fw, facts, bf16=bf16)[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
