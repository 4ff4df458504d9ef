"""Where a compiled step's time goes: native+compile vs unimp+compile, phase by phase and kernel by kernel.

    python bench/compiled_profile.py                    # GPU: torchvision ResNet-50 b128, mixed_bf16
    python bench/compiled_profile.py --model hf_llama   # the compiled suite's HF Llama
    python bench/compiled_profile.py --smoke            # tiny model on CPU (aot_eager): the script runs

For each variant (the same builds as ``bench/torch_gpu.py --suite compiled``): forward, backward and
optimizer phases timed apart (CUDA events, median), host time per step without a sync (does the
Python side keep up with the GPU?), and a ``torch.profiler`` pass listing every kernel whose total
device time differs between the two variants (count and µs per step). Used to explain a ratio, not
to state one: the ratio comes from ``bench/torch_gpu.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_gpu import _loss, compiled_workloads, native_step, unimp_step  # the suite's own builds


def _phases(model_fwd: Any, backward: Any, opt_step: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
            cuda: bool) -> dict[str, float]:
    """Median ms of forward, backward, optimizer (events between phases) and host ms per step."""
    names = ("forward", "backward", "optimizer")
    acc: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        t0 = time.perf_counter()
        if cuda:
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            ev[0].record()
        loss = _loss(model_fwd(x), y)
        if cuda:
            ev[1].record()
        backward(loss)
        if cuda:
            ev[2].record()
        opt_step()
        if cuda:
            ev[3].record()
        acc["host (no sync)"].append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize()
            for i, n in enumerate(names):
                acc[n].append(ev[i].elapsed_time(ev[i + 1]))
            acc["step"].append(ev[0].elapsed_time(ev[3]))
    return {k: statistics.median(v) for k, v in acc.items()}


def _kernels(step: Any, x: torch.Tensor, y: torch.Tensor, steps: int) -> dict[str, tuple[int, float]]:
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
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    backend = "aot_eager" if args.smoke else "inductor"
    build, data = compiled_workloads(args.smoke, device)[args.model]
    x, y = data()
    res: dict[str, Any] = {}
    for label in ("native+compile", "unimp+compile"):
        torch.manual_seed(0)
        model = build().to(device)
        if label == "native+compile":
            compiled = torch.compile(model, backend=backend)
            step = native_step(args.policy, compiled, device)
            # the same step in phases: native_step's own pieces
            cl = any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
            low = torch.bfloat16 if "bf16" in args.policy else torch.float16
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def fwd(t: torch.Tensor, compiled: Any = compiled, cl: bool = cl, low: torch.dtype = low) -> Any:
                if cl:
                    t = t.contiguous(memory_format=torch.channels_last)
                with torch.autocast(device, dtype=low):
                    return compiled(t)
            back = torch.Tensor.backward

            def ostep(opt: Any = opt) -> None:
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            step, amp = unimp_step(args.policy, model, backend)
            fwd = torch.compile(amp.model, backend=backend)
            back = amp.backward

            def ostep(amp: Any = amp) -> None:
                amp.optimizer.step()
                amp.optimizer.zero_grad()
        for _ in range(5):
            step(x, y)
        for _ in range(3):
            _loss(fwd(x), y).backward() if back is torch.Tensor.backward else back(_loss(fwd(x), y))
            ostep()
        res[label] = {"phases": _phases(fwd, back, ostep, x, y, args.steps, cuda),
                      "kernels": _kernels(step, x, y, 5)}
        ph = res[label]["phases"]
        print(label, {k: round(v, 3) for k, v in ph.items()}, flush=True)
        del step, model
    a, b = (res[k]["kernels"] for k in ("native+compile", "unimp+compile"))
    tot = {k: sum(v[1] for v in res[k]["kernels"].values()) / 1e3 for k in res}
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
