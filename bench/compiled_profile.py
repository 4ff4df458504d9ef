"""Where a compiled step's time goes: native+compile vs unimp+compile, kernel by kernel.

    python bench/compiled_profile.py                    # GPU: torchvision ResNet-50 b128, mixed_bf16
    python bench/compiled_profile.py --model hf_llama   # the compiled suite's HF Llama
    python bench/compiled_profile.py --smoke            # tiny model on CPU (aot_eager): the script runs

For each build (``bench/torch_gpu.py``'s own steps, compiled as its compiled suite compiles them): the
median step time (CUDA events; the two builds alternate step by step) and the host time a step takes
to issue its work (no sync: does the Python side keep up with the GPU?), then a ``torch.profiler``
pass listing every kernel whose device time differs between the two builds (calls and µs per step).
Used to explain a ratio, not to state one: the ratio comes from ``bench/torch_gpu.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_gpu import _ms, _timed, compiled_workloads, native_step, unimp_step  # the suite's own builds


def _kernels(step: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, tuple[float, float]]:
    """name -> (calls per step, device µs per step) from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step(x, y)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if dev > 0:
            out[e.key] = (round(e.count / steps, 2), dev / steps)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="resnet50", choices=("resnet50", "hf_llama"))
    ap.add_argument("--policy", default="mixed_bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    backend = "aot_eager" if args.smoke else "inductor"
    build, data = compiled_workloads(args.smoke, device)[args.model]
    x, y = data()
    steps: dict[str, Any] = {}
    for label in ("native+compile", "unimp+compile"):
        torch.manual_seed(0)
        model = build().to(device)
        if label == "native+compile":
            steps[label] = native_step(args.policy, torch.compile(model, backend=backend), device)
        else:
            steps[label], amp = unimp_step(args.policy, model, backend)
            steps[label].amp = amp  # alive as long as the step
        for _ in range(5):  # compiles here
            steps[label](x, y)
    timed = {k: _timed(s, x, y, device) for k, s in steps.items()}
    acc: dict[str, dict[str, list[float]]] = {k: {"step": [], "host": []} for k in steps}
    for _ in range(args.steps):  # alternating step by step
        for label, run in timed.items():
            t = time.perf_counter()
            sample = run()
            acc[label]["host"].append((time.perf_counter() - t) * 1e3)
            acc[label]["step"] += _ms([sample])
    res: dict[str, Any] = {}
    for label in steps:
        res[label] = {"step_ms": statistics.median(acc[label]["step"]),
                      "host_ms": statistics.median(acc[label]["host"]),
                      "kernels": _kernels(steps[label], x, y, 5)}
        print(f"{label}: step {res[label]['step_ms']:.3f} ms, host (no sync) {res[label]['host_ms']:.3f} ms",
              flush=True)
    a, b = (res[k]["kernels"] for k in ("native+compile", "unimp+compile"))
    tot = {k: sum(v[1] for v in res[k]["kernels"].values()) / 1e3 for k in steps}
    print(f"\nkernel time per step (ms): native+compile {tot['native+compile']:.3f}, "
          f"unimp+compile {tot['unimp+compile']:.3f}")
    diff = sorted(((b.get(k, (0, 0))[1] - a.get(k, (0, 0))[1], k) for k in set(a) | set(b)),
                  key=lambda t: -abs(t[0]))
    print("\nkernels whose device time differs most (µs per step, unimp - native; calls native/unimp):")
    for d, k in diff[:30]:
        print(f"{d:+10.1f}  {a.get(k, (0, 0))[0]:6}/{b.get(k, (0, 0))[0]:<6} {k[:110]}")
    res["kernel_ms_per_step"] = tot
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"compiled_profile_{args.model}.json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
