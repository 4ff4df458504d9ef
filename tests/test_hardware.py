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
    assert hardware.parse_features("-avx512_bf16", host=host)[1] == host.features - {"avx512_bf16"}  # from host
    assert hardware.parse_features("arm64_fp16", host=facts("arm64_bf16"))[1] == frozenset(LEVELS["arm64_fp16"])


@pytest.mark.parametrize("spec, host, asked", [
    ("amx", "avx2", "amx_bf16"),  # the case: would make `auto` pick bf16 on an AVX2-only CPU
    ("avx512_bf16", "avx512", "avx512_bf16"),
    ("avx2,avx512_bf16", "avx2", "avx512_bf16"),  # a single flag
    ("host,amx_fp16", "amx", "amx_fp16"),
    ("arm64_bf16", "arm64_fp16", "bf16"),
])
def test_a_simulation_cannot_add_a_feature_the_host_lacks(spec, host, asked):
    with pytest.raises(PolicyError, match=rf"UNIMP_CPU_FEATURES='{spec}'.*asks for .*{asked}.*which this CPU lacks"
                                          rf".*test CPU.*can only take features away"):
        hardware.parse_features(spec, host=facts(host))


@pytest.mark.parametrize("spec, host", [("arm64", "avx512_bf16"), ("avx2", "arm64_bf16")])
def test_a_simulation_cannot_change_the_architecture(spec, host):
    with pytest.raises(PolicyError, match=rf"'{spec}' is an .* CPU class and this CPU is"):
        hardware.parse_features(spec, host=facts(host))


def test_a_class_keeps_only_the_minor_flags_the_host_has_and_the_caps_follow():
    skylake_sp = CpuFacts("x86_64", "test CPU", frozenset(LEVELS["avx512"]) - {"avx512_vnni"})  # no VNNI
    sim = hardware.simulated("avx512", skylake_sp)
    assert sim.features == skylake_sp.features and sim.avx512_core and not sim.native_bf16
    env = hardware.simulated_env("avx512", base={}, host=skylake_sp)
    assert env["ONEDNN_MAX_CPU_ISA"] == hardware.onednn_isa(sim) == "AVX512_CORE"  # not AVX512_CORE_VNNI


@pytest.mark.parametrize("spec, match", [("", "empty; name a CPU class"), (" , ", "empty"),
                                         ("avx2," * 300, "longer than 1024 characters")])
def test_an_empty_or_unbounded_spec_is_a_located_error(spec, match):
    with pytest.raises(PolicyError, match=rf"UNIMP_CPU_FEATURES=.*{match}"):
        hardware.parse_features(spec, host=facts("avx512_bf16"))


def test_a_bad_token_names_the_variable_and_the_choices():
    with pytest.raises(PolicyError, match=r"UNIMP_CPU_FEATURES='avx3'.*unknown token 'avx3'.*avx2.*'-'"):
        hardware.parse_features("avx3", host=facts("avx2"))


def test_the_environment_variable_replaces_the_host_facts(monkeypatch):
    monkeypatch.setattr(hardware, "host", lambda: facts("avx512_bf16"))
    monkeypatch.setenv(hardware.ENV, "avx2")
    sim = hardware.cpu()
    assert sim.simulated == "avx2" and not sim.native_bf16 and sim.model == "test CPU"
    assert "[simulated: UNIMP_CPU_FEATURES=avx2]" in sim.describe()
    monkeypatch.setenv(hardware.ENV, "")  # empty: the real CPU, as unset
    assert hardware.cpu() == facts("avx512_bf16")
    monkeypatch.delenv(hardware.ENV)
    assert hardware.cpu() == facts("avx512_bf16")


def test_the_environment_variable_cannot_make_auto_pick_bf16_on_a_cpu_without_bf16_units(monkeypatch):
    monkeypatch.setattr(hardware, "host", lambda: facts("avx2"))
    monkeypatch.setenv(hardware.ENV, "amx")
    with pytest.raises(PolicyError, match="'amx' asks for .*amx_bf16.*which this CPU lacks"):
        hardware.resolve_cpu_auto("torch")
    monkeypatch.setenv(hardware.ENV, "host")
    assert hardware.resolve_cpu_auto("torch")[0] == "float32"
    with pytest.warns(UnimpWarning, match="no native bfloat16 units"):  # an explicit bf16 is still warned
        hardware.warn_emulated("bfloat16", "compute_dtype", "torch")


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
def test_simulated_env_tells_onednn_aten_and_xla_the_same_cpu(spec, isa, aten, monkeypatch):
    host = CpuFacts("x86_64", "test CPU", frozenset(LEVELS["amx"]) | {"avx_vnni", "avx_ne_convert"})
    env = hardware.simulated_env(spec, base={"XLA_FLAGS": "--xla_force_host_platform_device_count=2 "
                                                          "--xla_cpu_max_isa=AVX512"}, host=host)
    assert env[hardware.ENV] == spec and env["ONEDNN_MAX_CPU_ISA"] == env["DNNL_MAX_CPU_ISA"] == isa
    assert env["ATEN_CPU_CAPABILITY"] == aten
    assert ("TF_ENABLE_ONEDNN_OPTS" in env) is (spec == "avx2")  # TF aborts on oneDNN capped below bf16
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=2",
                                        f"--xla_cpu_max_isa={'AVX2' if aten == 'avx2' else 'AVX512'}"]
    monkeypatch.setattr(hardware, "host", lambda: host)  # what unimp reports in the child is what the caps say
    monkeypatch.setenv(hardware.ENV, env[hardware.ENV])
    assert hardware.onednn_isa(hardware.cpu()) == env["ONEDNN_MAX_CPU_ISA"]


def hardware_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unimp.hardware", *args], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=60)


def test_simulate_command_runs_a_child_that_sees_the_simulated_cpu():
    spec = "host,-avx512_bf16,-amx_bf16,-bf16"  # fewer features than any host has: no bf16 units anywhere
    code = ("import os; from unimp import hardware; f = hardware.cpu(); "
            "print(f.native_bf16, f.features == hardware.simulated(os.environ['UNIMP_CPU_FEATURES']).features, "
            "os.environ.get('ONEDNN_MAX_CPU_ISA') == hardware.onednn_isa(f))")
    out = hardware_cli("--simulate", spec, "--", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"]


@pytest.mark.parametrize("args, rc, message", [
    (["--simulate", "avx3"], 2, "UNIMP_CPU_FEATURES='avx3': unknown token 'avx3'"),
    (["--simulate", ""], 2, "UNIMP_CPU_FEATURES='': empty"),
    (["--simulate"], 2, "--simulate needs a SPEC"),
    (["--simulate", "--", "true"], 2, "--simulate needs a SPEC"),
    (["--simulate", "host", "--", "/nonexistent/unimp-cmd"], 127, "cannot run '/nonexistent/unimp-cmd'"),
    (["--frobnicate"], 2, "usage: python -m unimp.hardware"),
])
def test_simulate_command_reports_bad_input_in_one_located_line(args, rc, message):
    out = hardware_cli(*args)
    assert out.returncode == rc and message in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_simulate_command_refuses_a_cpu_the_host_is_not():
    other = "avx2" if hardware.host().arch == "arm64" else "arm64_bf16"  # another architecture than this one
    out = hardware_cli("--simulate", other, "--", sys.executable, "-c", "print('ran')")
    assert out.returncode == 2 and "can only take features away" in out.stderr and "ran" not in out.stdout


def test_emulated_dtype_warning_points_at_the_callers_line_and_names_the_fix():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        msg = hardware.warn_emulated("bfloat16", "compute_dtype", "torch", facts("avx2"))
    assert msg is not None and "0.38x" in msg and 'compute_dtype = "auto"' in msg
    (w,) = [w for w in caught if issubclass(w.category, UnimpWarning)]
    assert (w.filename, w.lineno) == (__file__, line)
    assert hardware.warn_emulated("bfloat16", "compute_dtype", "torch", facts("avx512_bf16")) is None
