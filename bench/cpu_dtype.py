"""bf16 vs fp32 training-step time of the README demo model on this CPU, or on a simulated one.

    python bench/cpu_dtype.py [--steps 20] [--policy examples/team_policy.toml]
    python -m unimp.hardware --simulate avx2 -- python bench/cpu_dtype.py   # an AVX2-only CPU

The float32 model and the policy's model live in one process and alternate step by step (the
CPU is shared); medians after 3 warm-up steps. Prints the CPU facts and the simulation variables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import unimp
from unimp import hardware

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from torch_train import ConvTransformer, data  # noqa: E402  (the README demo's model and batch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--policy", default=str(ROOT / "examples" / "team_policy.toml"))
    args = ap.parse_args()
    x, y = data("cpu")
    runs = {}
    for name in ("fp32", "policy"):
        torch.manual_seed(0)
        model = ConvTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        if name == "policy":
            amp = unimp.apply(args.policy, model, opt, backend="torch")
            runs[name] = (amp.model, amp.optimizer, amp.backward, amp.plan.compute_dtype)
        else:
            runs[name] = (model, opt, lambda loss: loss.backward(), "float32")
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.steps + 3):
        for name, (model, opt, backward, _) in runs.items():
            t = time.perf_counter()
            backward(F.cross_entropy(model(x).float(), y))
            opt.step()
            opt.zero_grad()
            if i >= 3:
                times[name].append(time.perf_counter() - t)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    env = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY") if k in os.environ}
    print(f"cpu: {hardware.cpu().describe()}; torch {torch.__version__} "
          f"(capability {torch.backends.cpu.get_cpu_capability()}); env {env or '-'}")
    print(f"fp32 {ms['fp32']:.0f} ms/step, policy ({runs['policy'][3]}) {ms['policy']:.0f} ms/step: "
          f"{ms['fp32'] / ms['policy']:.2f}x the speed of fp32 (median of {args.steps})")


if __name__ == "__main__":
    main()
