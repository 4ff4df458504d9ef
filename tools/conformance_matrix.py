"""Repository tool: compare every backend's observations and write the published conformance matrix.

    python tools/conformance_matrix.py --obs .obs --envs .tox --docs docs

Fails (exit 1) with one line per disagreement — naming the backends, the policy, the layer or
step, expected and observed — and when a check that passed in the committed baseline
(``docs/conformance.json``) no longer passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path
from typing import Any

from unimp.conformance.checks import close, loss_tolerance
from unimp.conformance.expect import expected_layers, expected_output_dtype
from unimp.conformance.observe import RESUME_RULE, observation_policy
from unimp.conformance.probe import PROBE
from unimp.loss_scale import LossScale, LossScaleState
from unimp.report import format_table

FP32_CROSS_TOLERANCE = 1e-4  # fp32 loss curves of the five frameworks agree to ~1e-6 under plain SGD
# observation label -> (unimp backend, tox env, environment variables): one Keras adapter, one column per Keras backend
TARGETS: dict[str, tuple[str, str, dict[str, str]]] = {
    "torch": ("torch", "torch", {}), "jax": ("jax", "jax", {"JAX_PLATFORMS": "cpu"}),
    "paddle": ("paddle", "paddle", {}), "ipex": ("ipex", "ipex", {}),
    **{f"keras-{kb}": ("keras", f"keras-{kb}", {"KERAS_BACKEND": kb, "JAX_PLATFORMS": "cpu"})
       for kb in ("tensorflow", "jax", "torch")},
}


def _ok(entry: Any) -> bool:
    return isinstance(entry, dict | list) and not (isinstance(entry, dict) and ({"n/a", "error"} & set(entry)))


def compare_dtypes(obs: dict[str, dict]) -> list[str]:
    """Where two backends both control a layer's op, their observed dtypes must be identical."""
    problems = []
    for a, b in combinations(sorted(obs), 2):
        for pol, da in obs[a]["dtypes"].items():
            db = obs[b]["dtypes"].get(pol)
            if not (_ok(da) and _ok(db)):
                continue
            for layer in PROBE:
                ca, cb = da["control"].get(layer.kind), db["control"].get(layer.kind)
                if "fixed" in (ca, cb) or not (da["honoured"].get(layer.kind) and db["honoured"].get(layer.kind)):
                    continue
                va, vb = da["layers"].get(layer.path), db["layers"].get(layer.path)
                if va != vb:
                    exp = expected_layers(observation_policy(pol), da["compute_dtype"])[layer.path]
                    problems.append(
                        f"dtypes: policy {pol}, layer {layer.path} ({layer.kind}): {a} observed {va}, {b} observed "
                        f"{vb}; the core expects {[exp.compute_dtype, exp.param_dtype, exp.output_dtype]}")
            last = PROBE[-1].kind  # the model's output: cast to output_dtype, or "unchanged" = the last layer's
            if (da.get("output") and db.get("output") and da["output"] != db["output"] and "fixed" not in
                    (da["control"].get(last), db["control"].get(last))
                    and da["honoured"].get(last) and db["honoured"].get(last)):
                problems.append(f"dtypes: policy {pol}, model output: {a} observed {da['output']}, {b} observed "
                                f"{db['output']}; the core expects "
                                f"{expected_output_dtype(observation_policy(pol), da['compute_dtype'])}")
    return problems


def compare_trajectories(obs: dict[str, dict]) -> list[str]:
    """Every backend's scale sequence and skip counts equal the reference."""
    problems = []
    for backend, o in sorted(obs.items()):
        for rule, t in o["trajectories"].items():
            if isinstance(t, dict) and "n/a" in t:  # declared unsupported here (a located UnsupportedError)
                continue
            if not _ok(t):
                problems.append(f"trajectory: {backend} could not run {rule}: {t}")
                continue
            spec = observation_policy(rule).loss_scale
            state = LossScale(spec).initial_state()
            for i, poison in enumerate(t["pattern"]):
                state = LossScale(spec).update(state, not poison).state
                got = (t["scales"][i], t["skipped"][i])
                if got != (state.scale, state.skipped):
                    problems.append(f"trajectory: {backend}, {rule}, step {i}: expected (scale, skipped) "
                                    f"{(state.scale, state.skipped)}, observed {got}")
                    break
    return problems


def _tol(pol: str) -> float:
    return loss_tolerance(observation_policy(pol))


def compare_losses(obs: dict[str, dict]) -> list[str]:
    """Loss curves of the same policy agree across backends (and with fp32) within tolerance."""
    problems = []
    for a, b in combinations(sorted(obs), 2):
        for pol, la in obs[a]["losses"].items():
            lb = obs[b]["losses"].get(pol)
            if not (_ok(la) and _ok(lb)):
                continue
            tol = max(_tol(pol), FP32_CROSS_TOLERANCE)
            for i, (x, y) in enumerate(zip(la, lb, strict=True)):
                if not close(x, y, tol):
                    problems.append(f"losses: policy {pol}, step {i}: {a} {x:.6f} vs {b} {y:.6f} "
                                    f"(tolerance {tol})")
                    break
    for backend, o in obs.items():
        base = o["losses"].get("fp32")
        for pol, la in o["losses"].items():
            if _ok(la) and _ok(base):
                tol = _tol(pol)
                bad = [i for i, (x, y) in enumerate(zip(la, base, strict=True)) if not close(x, y, tol)]
                if bad:
                    problems.append(f"losses: {backend}, policy {pol}, step {bad[0]}: {la[bad[0]]:.6f} vs fp32 "
                                    f"{base[bad[0]]:.6f} (tolerance {tol})")
    return problems


def run_resumes(obs_dir: Path, envs: Path | None, backends: list[str]) -> None:
    """Continue every backend's checkpoint in every other backend, each in its own environment."""
    for target in backends:
        backend, env, variables = TARGETS.get(target, (target, target, {}))
        py = (envs / env / "bin" / "python") if envs else Path(sys.executable)
        if not py.exists():
            continue
        sources = [str(obs_dir / f"{s}.json") for s in backends if s != target]
        subprocess.run([str(py), "-m", "unimp.conformance.observe", backend, "--out", str(obs_dir),
                        "--resume", *sources], check=False, timeout=900, env={**os.environ, **variables})


def compare_resumes(obs_dir: Path, obs: dict[str, dict]) -> tuple[list[str], dict[tuple[str, str], str]]:
    """Resumed runs continue the reference exactly and start from the source's loss."""
    problems, matrix = [], {}
    spec = observation_policy(RESUME_RULE).loss_scale
    for a in sorted(obs):
        for b in sorted(obs):
            if a == b:
                continue
            f = obs_dir / f"resume-{a}-{b}.json"
            if "n/a" in obs[a]["checkpoint"] or "n/a" in obs[b]["checkpoint"]:
                # a backend that declared the resume rule unsupported (a located UnsupportedError in its
                # observation, e.g. a float32 subnormal scale where XLA flushes) neither writes nor continues one
                matrix[(a, b)] = "n/a"
                continue
            if not f.exists():
                matrix[(a, b)] = "missing"
                problems.append(f"resume {a} -> {b}: not run")
                continue
            r = json.loads(f.read_text())
            if "error" in r or "n/a" in r:
                matrix[(a, b)] = "fail"
                problems.append(f"resume {a} -> {b}: {r.get('error') or r.get('n/a')}")
                continue
            ckpt = obs[a]["checkpoint"]
            state = LossScaleState.from_dict(ckpt["state"])
            pattern = obs[a]["trajectories"][RESUME_RULE]["pattern"][ckpt["at"]:]
            expected = []
            for poison in pattern:
                state = LossScale(spec).update(state, not poison).state
                expected.append(state.scale)
            src = obs[a]["trajectories"][RESUME_RULE]
            src_loss = None if src["pattern"][ckpt["at"]] else src["losses"][ckpt["at"]]  # poisoned: no loss
            ok = r["scales"] == expected
            near = src_loss is None or close(r["first_loss"], src_loss, FP32_CROSS_TOLERANCE)
            matrix[(a, b)] = "pass" if ok and near else "fail"
            if not ok:
                problems.append(f"resume {a} -> {b}: expected scales {expected}, observed {r['scales']}")
            if not near:
                problems.append(f"resume {a} -> {b}: first loss {r['first_loss']:.6f}, {a} had {src_loss:.6f}")
    return problems, matrix


HARDWARE_KEY = "_hardware"  # the baseline's record of the CPU it was produced on (unimp.hardware)


def hardware_lines(obs: dict[str, dict]) -> list[str]:
    """Where the observations were made: one line per distinct CPU (model, features, simulation)."""
    seen: dict[str, list[str]] = {}
    for b, o in sorted(obs.items()):
        hw = o.get("hardware")
        text = (f"{hw['describe']}; features: {' '.join(hw['features']) or '(none read)'}" if hw
                else "not recorded")
        seen.setdefault(text, []).append(b)
    if len(seen) == 1:
        return [f"Produced on: {next(iter(seen))}."]
    return [f"Produced on ({', '.join(bs)}): {text}." for text, bs in seen.items()]


def same_hardware(a: dict | None, b: dict | None) -> bool:
    """Whether two hardware records are the same CPU for low precision (architecture and features)."""
    return bool(a and b) and (a["arch"], sorted(a["features"])) == (b["arch"], sorted(b["features"]))


def matrix_markdown(obs: dict[str, dict], resume: dict[tuple[str, str], str], problems: list[str]) -> str:
    backends = sorted(obs)
    cells: dict[tuple[str, str], str] = {}
    for b in backends:
        for r in obs[b]["results"]:
            key = (f"{r['check']}[{r['policy']}]", b)
            d = obs[b]["dtypes"].get(r["policy"])
            passed = "pass (fallback)" if _ok(d) and d.get("fallback") else "pass"
            cells[key] = {"pass": passed, "fail": "**FAIL**"}.get(r["status"], f"n/a: {r['detail'][:60].strip()}")
    checks = sorted({k[0] for k in cells})
    lines = ["# Conformance matrix", "",
             "Generated by `python tools/conformance_matrix.py` (the `conformance` tox env) from every backend's",
             "observations on this CPU machine. n/a carries the reason the backend gave; \"pass (fallback)\"",
             "means the check passed against the backend's reported fallback (the Plan says which ops or params",
             "could not run in low precision here, e.g. Paddle dygraph on CPU), not low precision.", "",
             *hardware_lines(obs), "",
             "## Checks (backend x check[policy])", "", "| check | " + " | ".join(backends) + " |",
             "|---|" + "---|" * len(backends)]
    lines += [f"| {c} | " + " | ".join(cells.get((c, b), "-") for b in backends) + " |" for c in checks]
    def control(b: str, policy: str) -> dict:
        d = obs[b]["dtypes"].get(policy)
        return d["control"] if _ok(d) else {}

    # mixed_bf16, the custom op-list policy, and each other policy whose control levels differ
    policies = sorted({p for o in obs.values() for p, d in o["dtypes"].items() if _ok(d) and d.get("control")},
                      key=lambda p: (p != "mixed_bf16", p))
    policies = [p for p in policies if p in ("mixed_bf16", "custom_moved_ops") or any(
        control(b, p) and control(b, "mixed_bf16") and control(b, p) != control(b, "mixed_bf16") for b in backends)]
    for policy in policies:
        lines += ["", f"## Control level per canonical op: {policy}", "",
                  "| op | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        ops = next((o["dtypes"][policy]["control"] for o in obs.values() if _ok(o["dtypes"].get(policy))), {})
        for op in ops:
            row = []
            for b in backends:
                d = obs[b]["dtypes"].get(policy)
                row.append(d["control"].get(op, "-") if _ok(d) else "-")
            lines.append(f"| {op} | " + " | ".join(row) + " |")
    lines += ["", "## Cross-framework resume (row saved, column resumed)", "",
              "| from \\ to | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
    for a in backends:
        lines.append(f"| {a} | " + " | ".join("-" if a == b else resume.get((a, b), "-") for b in backends) + " |")
    lines += ["", "## Cross-backend comparison", ""]
    lines += [f"- {p}" for p in problems] or ["All dtype tables, scale trajectories, loss curves and resumes agree."]
    return "\n".join(lines) + "\n"


def regressions(baseline: dict[str, Any], current: dict[str, Any], hardware: dict | None = None) -> list[str]:
    """Checks that passed in the baseline and do not pass now (a missing backend counts).

    Like with like: on other hardware than the baseline's (``hardware`` vs its ``_hardware`` record),
    a check that is n/a here (e.g. float16 on a CPU without float16 units) is not a regression.
    """
    like = same_hardware(baseline.get(HARDWARE_KEY), hardware)
    return [f"regression: {k} passed before, now {current.get(k, 'missing')}"
            for k, v in baseline.items() if v == "pass" and current.get(k) != "pass"
            and (like or current.get(k) != "n/a")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/conformance_matrix.py")
    ap.add_argument("--obs", default=".obs")
    ap.add_argument("--envs", default=None, help="tox work dir holding one env per backend (for resumes)")
    ap.add_argument("--docs", default="docs")
    ap.add_argument("--update-baseline", action="store_true")
    args = ap.parse_args(argv)
    obs_dir = Path(args.obs)
    obs = {p.stem: json.loads(p.read_text()) for p in sorted(obs_dir.glob("*.json"))
           if not p.stem.startswith("resume-")}
    if len(obs) < 2:
        print(f"need observations of at least two backends in {obs_dir}, found {sorted(obs)}")
        return 1
    run_resumes(obs_dir, Path(args.envs) if args.envs else None, sorted(obs))
    problems = compare_dtypes(obs) + compare_trajectories(obs) + compare_losses(obs)
    resume_problems, resume = compare_resumes(obs_dir, obs)
    problems += resume_problems
    for b, o in sorted(obs.items()):
        problems += [f"check: {b}: {r['check']}[{r['policy']}]: {r['detail']}" for r in o["results"]
                     if r["status"] == "fail"]
    current = {f"{b}:{r['check']}[{r['policy']}]": r["status"] for b, o in obs.items() for r in o["results"]}
    current.update({f"resume:{a}->{b}": s for (a, b), s in resume.items()})
    docs = Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    baseline_file = docs / "conformance.json"
    baseline = json.loads(baseline_file.read_text()) if baseline_file.exists() else {}
    hardware = next((o["hardware"] for o in obs.values() if o.get("hardware")), None)
    problems += regressions(baseline, current, hardware)
    (docs / "conformance.md").write_text(matrix_markdown(obs, resume, problems))
    if args.update_baseline:
        baseline_file.write_text(json.dumps({**current, HARDWARE_KEY: hardware}, indent=1, sort_keys=True) + "\n")
    summary = [(b, str(sum(r["status"] == "pass" for r in o["results"])),
                str(sum(r["status"] == "n/a" for r in o["results"])),
                str(sum(r["status"] == "fail" for r in o["results"]))) for b, o in sorted(obs.items())]
    print(format_table(("backend", "pass", "n/a", "fail"), summary, title="conformance"))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
