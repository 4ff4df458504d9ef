"""A sixth framework touching no core file: the NumPy reference backend in tests/sixth_backend runs
every conformance check its tags allow (registered here; ``test_found_through_its_entry_point`` shows
that installing the package is all the core needs to find it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import unimp
from unimp.conformance import cases, run_case

sys.path.insert(0, str(Path(__file__).parent / "sixth_backend"))
from unimp_numpy.backend import NumpyBackend
from unimp_numpy.testing import NumpyKit

if "numpy" not in unimp.backends():
    unimp.backend.registry.register_backend(NumpyBackend)

APPLICABLE = {"check_layer_dtypes[fp32]", "check_numerics[mixed_fp16]", "check_loss_scale_trajectory[mixed_fp16]",
              "check_state_dict_roundtrip[mixed_fp16]",
              "check_alignment_findings[fp32]", "check_remove_restores[fp32]", "check_overrides[mixed_fp16]",
              "check_amp_surface[fp32]", "check_amp_surface[mixed_fp16]", "check_loss_scale_follows_plan[fp32]"}


@pytest.mark.parametrize("case", cases(), ids=str)
def test_conformance(case):
    run_case(case, NumpyKit())


def test_tags_select_the_checks():
    """bf16 and master-weight cases are not applicable by tags; the fp16/fp32 ones all run."""
    results = {f"{r.check}[{r.policy}]": r for r in unimp.conformance.run(NumpyKit())}
    assert not [k for k, r in results.items() if r.status == "fail"], results
    assert all(results[k].status == "pass" for k in APPLICABLE)
    assert "bf16" in results["check_layer_dtypes[mixed_bf16]"].detail
    assert "master_weights" in results["check_master_weights[fp32]"].detail


def test_written_against_unimp_spi_only():
    from imports import PLUGIN_MODULES, core_uses

    pkg = Path(__file__).parent / "sixth_backend" / "unimp_numpy"
    core = {mod for p in pkg.glob("*.py") for mod, _, how in core_uses(p, pkg) if how != "doctest"}
    assert "unimp.spi" in core and core <= PLUGIN_MODULES


def test_detected_and_explained():
    import numpy as np

    model = NumpyKit().build_probe(unimp.conformance.probe_weights(0))
    assert unimp.detect(model).name == "numpy"
    amp = unimp.apply("mixed_fp16", model, None)
    out = amp.model(np.zeros((1, 4), np.int32))
    assert out.dtype == np.float32 and amp.report().row("fc1").compute_dtype == "float16"
    assert amp.plan.layer("head").decision.compute_dtype == "float16" and amp.plan.loss_scale.mode == "dynamic"
    amp.remove()


def test_found_through_its_entry_point(tmp_path):
    """Installed (a dist-info with the entry point its pyproject declares), the core finds and applies it
    with no registration call and no core change."""
    import os
    import subprocess
    import tomllib

    here = Path(__file__).parent / "sixth_backend"
    project = tomllib.loads((here / "pyproject.toml").read_text())["project"]
    eps = project["entry-points"]["unimp.backends"]
    info = tmp_path / f"unimp_numpy-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("[unimp.backends]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    code = ("import numpy as np, unimp\n"
            "from unimp_numpy.testing import NumpyKit\n"
            "assert 'numpy' in unimp.backends(), unimp.backends()\n"
            "m = NumpyKit().build_probe(unimp.conformance.probe_weights(0))\n"
            "amp = unimp.apply('mixed_fp16', m)\n"
            "amp.model(np.zeros((1, 4), np.int32))\n"
            "print(amp.plan.backend, amp.report().row('fc1').compute_dtype)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(here), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["numpy", "float16"]


class _CastsAnyway(NumpyKit):
    """A broken backend: casts the model's output to float32 whatever the policy says."""

    def apply(self, policy, model, optimizer):
        amp = super().apply(policy, model, optimizer)
        model.output_dtype = "float32"
        return amp


class _NeverCasts(NumpyKit):
    """A broken backend: never casts the model's output."""

    def apply(self, policy, model, optimizer):
        amp = super().apply(policy, model, optimizer)
        model.output_dtype = None
        return amp


@pytest.mark.parametrize(("kit", "fails_on"), [(_CastsAnyway, "unchanged"), (_NeverCasts, "float32")])
def test_output_dtype_check_catches_a_wrong_cast(kit, fails_on):
    """check_output_dtype runs each policy with its last op lowered both ways, so a backend that casts an
    "unchanged" output (or leaves a "float32" one low) fails, even under a preset whose last op is float32."""
    from unimp.conformance import ConformanceFailure
    from unimp.conformance.checks import check_output_dtype

    pol = unimp.load("mixed_fp16")
    assert pol.output_dtype == "unchanged"
    check_output_dtype(NumpyKit(), pol)
    with pytest.raises(ConformanceFailure, match=f"output_{fails_on}.*model output dtype"):
        check_output_dtype(kit(), pol)
