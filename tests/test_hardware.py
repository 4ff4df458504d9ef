"""unimp.hardware: the CPU facts, the UNIMP_CPU_FEATURES grammar, simulated_env, the auto resolver."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from unimp import hardware
from unimp.errors import PolicyError, UnimpWarning
from unimp.hardware import LEVELS, CpuFacts

pytestmark = pytest.mark.hardware


def facts(level: str, *extra: str) -> CpuFacts:
    arch = "arm64" if level in hardware.ARM_LEVELS else "x86_64"
    return CpuFacts(arch, "test CPU", frozenset(LEVELS[level]) | set(extra))


@pytest.mark.parametrize("level, bf16, fp16, kernels", [
    ("avx2", False, False, False),
    ("avx2_ne_convert", False, False, True),  # IPEX/oneDNN bf16 kernels, but no bf16 dot-product units
    ("avx512", False, False, True),
    ("avx512_bf16", True, False, True),
    ("amx", True, False, True),
    ("amx_fp16", True, True, True),
    ("arm64", False, False, False),
    ("arm64_fp16", False, True, False),
    ("arm64_bf16", True, True, True),
])
def test_each_cpu_class_has_the_units_its_vendor_documents(level, bf16, fp16, kernels):
    f = facts(level)
    assert (f.native_bf16, f.native_fp16, f.bf16_kernels) == (bf16, fp16, kernels)
    assert f.emulated("bfloat16") is not bf16 and f.emulated("float16") is not fp16


@pytest.mark.parametrize("level, want", [("avx2", "float32"), ("avx512", "float32"), ("avx512_bf16", "bfloat16"),
                                         ("amx", "bfloat16"), ("arm64_fp16", "float32"), ("arm64_bf16", "bfloat16")])
def test_auto_is_bf16_only_with_native_units_and_says_why(level, want):
    dtype, reason = hardware.resolve_cpu_auto("torch", facts(level))
    assert dtype == want and "test CPU" in reason
    assert ("native bfloat16 units" in reason) if want == "bfloat16" else ("slower than float32" in reason)


def test_auto_fp16_only_for_frameworks_that_opt_in_and_never_where_the_framework_ignores_the_units():
    assert hardware.resolve_cpu_auto("torch", facts("arm64_fp16"), fp16=True)[0] == "float16"
    dtype, reason = hardware.resolve_cpu_auto("XLA:CPU", facts("amx"), bf16=False, why_not="XLA:CPU ignores them")
    assert dtype == "float32" and "XLA:CPU ignores them" in reason


def test_grammar_levels_host_flags_and_removal():
    host = facts("avx512_bf16")
    assert hardware.parse_features("avx2", host=host) == ("x86_64", frozenset(LEVELS["avx2"]))
    arch, flags = hardware.parse_features("host, -avx512_bf16", host=host)
    assert flags == host.features - {"avx512_bf16"}
    arch, flags = hardware.parse_features("avx512 avx512_bf16", host=host)
    assert CpuFacts(arch, "", flags).native_bf16
    assert hardware.parse_features("arm64,bf16", host=host)[0] == "arm64"


def test_a_bad_token_names_the_variable_and_the_choices():
    with pytest.raises(PolicyError, match=r"UNIMP_CPU_FEATURES='avx3'.*unknown token 'avx3'.*avx2.*'-'"):
        hardware.parse_features("avx3", host=facts("avx2"))


def test_the_environment_variable_replaces_the_host_facts(monkeypatch):
    monkeypatch.setenv(hardware.ENV, "avx2")
    sim = hardware.cpu()
    assert sim.simulated == "avx2" and not sim.native_bf16 and sim.model == hardware.host().model
    assert "[simulated: UNIMP_CPU_FEATURES=avx2]" in sim.describe()
    monkeypatch.delenv(hardware.ENV)
    assert hardware.cpu() == hardware.host()


def test_host_facts_are_this_cpus_proc_cpuinfo():
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")), None)
    if line is None:
        pytest.skip("no /proc/cpuinfo flags on this OS")
    assert hardware.host().features == frozenset(line.split(":", 1)[1].split()) & hardware.RELEVANT


@pytest.mark.parametrize("spec, isa, aten", [("avx2", "AVX2", "avx2"), ("avx512", "AVX512_CORE_VNNI", "avx512"),
                                             ("avx512_bf16", "AVX512_CORE_BF16", "avx512"),
                                             ("amx", "AVX512_CORE_AMX", "avx512"),
                                             ("avx2_ne_convert", "AVX2_VNNI_2", "avx2")])
def test_simulated_env_tells_onednn_aten_and_xla_the_same_cpu(spec, isa, aten):
    env = hardware.simulated_env(spec, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert env[hardware.ENV] == spec and env["ONEDNN_MAX_CPU_ISA"] == env["DNNL_MAX_CPU_ISA"] == isa
    assert env["ATEN_CPU_CAPABILITY"] == aten
    assert ("TF_ENABLE_ONEDNN_OPTS" in env) is (spec == "avx2")  # TF aborts on oneDNN capped below bf16
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2",
                                        f"--xla_cpu_max_isa={'AVX2' if aten == 'avx2' else 'AVX512'}"]


def test_simulate_command_runs_a_child_that_sees_the_simulated_cpu():
    code = ("import os; from unimp import hardware; f = hardware.cpu(); "
            "print(f.native_bf16, os.environ['ONEDNN_MAX_CPU_ISA'], os.environ['ATEN_CPU_CAPABILITY'])")
    out = subprocess.run([sys.executable, "-m", "unimp.hardware", "--simulate", "avx2", "--",
                          sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])
    assert out.stdout.split() == ["False", "AVX2", "avx2"]


def test_emulated_dtype_warning_points_at_the_callers_line_and_names_the_fix():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        msg = hardware.warn_emulated("bfloat16", "compute_dtype", "torch", facts("avx2"))
    assert msg is not None and "0.38x" in msg and 'compute_dtype = "auto"' in msg
    (w,) = [w for w in caught if issubclass(w.category, UnimpWarning)]
    assert (w.filename, w.lineno) == (__file__, line)
    assert hardware.warn_emulated("bfloat16", "compute_dtype", "torch", facts("avx512_bf16")) is None
