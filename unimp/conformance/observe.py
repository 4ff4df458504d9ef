"""Cross-backend observations: what one backend does with the shared probe, written as JSON.

Run inside a backend's environment (tox does this for every backend env)::

    python -m unimp.conformance.observe torch --out .obs
    python -m unimp.conformance.observe jax --resume .obs/torch.json --out .obs

The first form writes ``.obs/<label>.json`` (the kit's label: the backend's name, or
``keras-<Keras backend>``): the conformance results, observed dtypes per layer for each policy, the
Plan's control level per canonical op, loss-scale trajectories for shared overflow sequences,
per-step losses, and a checkpoint (canonical state + numpy weights).
The second continues other backends' checkpoints in this backend (cross-framework resume) and
writes ``.obs/resume-<from>-<to>.json``. ``tools/conformance_matrix.py`` (in the repository) compares them all.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

from unimp.conformance.checks import STANDARD_POLICIES, NotApplicable, run, setup, standard_policy
from unimp.conformance.kit import Kit
from unimp.conformance.probe import probe_batches, probe_weights
from unimp.errors import UnsupportedError
from unimp.files import write_file
from unimp.policy import Policy
from unimp.policy.loading import load

OBS_POLICIES = (*STANDARD_POLICIES, "custom_overrides")
CUSTOM_OVERRIDES = {"name": "custom_overrides", "extends": "mixed_bf16",
                    "overrides": [{"modules": ["hea*"], "compute_dtype": "float32"},
                                  {"types": ["activation"], "compute_dtype": "float32"}]}
_INF = math.inf
TRAJECTORY_RULES: dict[str, dict[str, Any]] = {
    "torch_rule": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 2, "min": 0.0, "max": _INF},
    "paddle_rule": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 2, "hysteresis": 2,
                    "hysteresis_refill": ["finite", "backoff"], "min": 1.0, "max": _INF},
    "flax_rule": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 2, "max": 4096.0,
                  "growth_schedule": "interval_plus_one", "on_max": "clamp", "min": 1.0},
    "deepspeed_rule": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 2, "hysteresis": 2,
                       "hysteresis_refill": ["growth"], "growth_schedule": "window", "min": 1.0,
                       "max": _INF},
}
RESUME_RULE = "torch_rule"
RESUME_AT = 7  # an unpoisoned step of overflow_pattern(), so the first resumed loss is finite
LOSS_STEPS = 8


def overflow_pattern(n: int = 14, seed: int = 7) -> list[bool]:
    """The shared sequence of poisoned (non-finite) steps: True = poison."""
    rng = random.Random(seed)
    return [rng.random() < 0.3 for _ in range(n)]


def observation_policy(name: str) -> Policy:
    if name == "custom_overrides":
        return load(CUSTOM_OVERRIDES)
    if name in TRAJECTORY_RULES:
        return load({"name": name, "extends": "fp32", "loss_scale": {**TRAJECTORY_RULES[name],
                                                                     "skip_nonfinite": True}})
    return standard_policy(name)


def _dtypes(kit: Kit, policy: Policy) -> dict[str, Any]:
    amp = setup(kit, policy)
    try:
        batch = probe_batches(1)[0]
        obs = kit.observe(amp, batch)
        return {"layers": {k: [v.compute_dtype, v.param_dtype, v.output_dtype] for k, v in obs.items()},
                "output": kit.dtype_name(kit.output(amp, batch)),  # the model's output (output_dtype)
                "control": {d.op: d.control for d in amp.plan.ops},
                "honoured": {d.op: d.honoured for d in amp.plan.ops},
                "fallback": bool(amp.plan.fallbacks or amp.plan.param_fallback or amp.plan.override_fallbacks),
                "compute_dtype": amp.plan.compute_dtype}
    finally:
        amp.remove()


def _trajectory(kit: Kit, policy: Policy, pattern: list[bool]) -> dict[str, Any]:
    amp = setup(kit, policy)
    scales, skipped, losses = [], [], []
    try:
        for poison, batch in zip(pattern, probe_batches(len(pattern)), strict=True):
            losses.append(kit.step(amp, batch, poison=poison))
            scales.append(amp.scale)
            skipped.append(amp.skipped_steps)
        return {"pattern": pattern, "scales": scales, "skipped": skipped,
                "losses": [x if math.isfinite(x) else None for x in losses]}
    finally:
        amp.remove()


def _losses(kit: Kit, policy: Policy) -> list[float]:
    """Per-step losses under plain SGD (the same update rule in every framework)."""
    reason = kit.why_not(policy)
    if reason:
        raise NotApplicable(reason)
    model = kit.build_probe(probe_weights(0))
    amp = kit.apply(policy, model, kit.make_sgd(model))
    try:
        return [kit.step(amp, b) for b in probe_batches(LOSS_STEPS)]
    finally:
        amp.remove()


def _checkpoint(kit: Kit) -> dict[str, Any]:
    policy = observation_policy(RESUME_RULE)
    pattern = overflow_pattern()
    amp = setup(kit, policy)
    try:
        for poison, batch in zip(pattern[:RESUME_AT], probe_batches(RESUME_AT), strict=True):
            kit.step(amp, batch, poison=poison)
        weights = {k: v.tolist() for k, v in kit.export_weights(amp).items()}
        return {"policy": RESUME_RULE, "at": RESUME_AT, "state": amp.state_dict(), "weights": weights}
    finally:
        amp.remove()


def _guard(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except NotApplicable as e:
        return {"n/a": str(e)}
    except (UnsupportedError, NotImplementedError) as e:
        return {"n/a": f"{type(e).__name__}: {e}"}
    except Exception as e:  # recorded, compared and reported, never hidden
        return {"error": f"{type(e).__name__}: {e}"}


def observe(kit: Kit) -> dict[str, Any]:
    """Everything the cross-backend comparison needs from one backend."""
    from unimp.hardware import cpu

    pattern = overflow_pattern()
    return {
        "backend": kit.label,
        "hardware": cpu().record(),
        "results": [r.__dict__ for r in run(kit)],
        "dtypes": {p: _guard(_dtypes, kit, observation_policy(p)) for p in OBS_POLICIES},
        "losses": {p: _guard(_losses, kit, observation_policy(p)) for p in OBS_POLICIES},
        "trajectories": {r: _guard(_trajectory, kit, observation_policy(r), pattern) for r in TRAJECTORY_RULES},
        "checkpoint": _guard(_checkpoint, kit),
    }


def resume(kit: Kit, source: dict[str, Any]) -> dict[str, Any]:
    """Continue another backend's checkpoint here: scales and the first loss after resuming."""
    import numpy as np

    ckpt = source["checkpoint"]
    policy = observation_policy(ckpt["policy"])
    pattern = overflow_pattern()
    model = kit.build_probe({k: np.asarray(v, np.float32) for k, v in ckpt["weights"].items()})
    amp = kit.apply(policy, model, kit.make_optimizer(model))
    try:
        amp.load_state_dict(ckpt["state"])
        scales, skipped, losses = [], [], []
        batches = probe_batches(len(pattern))
        for poison, batch in zip(pattern[ckpt["at"]:], batches[ckpt["at"]:], strict=True):
            losses.append(kit.step(amp, batch, poison=poison))
            scales.append(amp.scale)
            skipped.append(amp.skipped_steps)
        return {"from": source["backend"], "to": kit.label, "scales": scales, "skipped": skipped,
                "first_loss": losses[0]}
    finally:
        amp.remove()


def main(argv: list[str] | None = None) -> int:
    import unimp

    ap = argparse.ArgumentParser(prog="python -m unimp.conformance.observe")
    ap.add_argument("backend")
    ap.add_argument("--out", default=".obs")
    ap.add_argument("--resume", nargs="*", default=[], help="other backends' observation files to continue")
    args = ap.parse_args(argv)
    kit = unimp.get_backend(args.backend).conformance_kit()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.resume:
        write_file(out / f"{kit.label}.json", json.dumps(observe(kit), indent=1), where="--out")
        print(f"wrote {out / (kit.label + '.json')}")
        return 0
    for src in args.resume:
        source = json.loads(Path(src).read_text())
        if "state" not in source.get("checkpoint", {}):
            continue
        result = _guard(resume, kit, source)
        target = out / f"resume-{source['backend']}-{kit.label}.json"
        write_file(target, json.dumps({"from": source["backend"], "to": kit.label, **result}, indent=1), where="--out")
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
