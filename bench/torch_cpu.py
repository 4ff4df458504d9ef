"""CPU version of bench/torch_gpu.py: native torch CPU autocast vs ``unimp.apply``, smaller shapes.

    python bench/torch_cpu.py [--steps 25] [--policies mixed_bf16,...]

Both variants live in one process and alternate step by step (this CPU is shared), median of
>= 20 timed steps after warm-up. float16 is left out by default: this CPU has no fp16 matmul
units, so CPU fp16 autocast measures torch's fallback kernels, not unimp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_gpu as tg  # the shared models, native steps and harness

tg.POLICIES["torch_autocast_cpu"] = "torch_autocast_cpu"


def workloads(smoke: bool, device: str) -> dict:
    return {
        "resnet_small": (lambda: tg.ResNet((1, 1, 1, 1), 16, 100),
                         lambda: (torch.randn(16, 3, 64, 64), torch.randint(0, 100, (16,)))),
        "gpt_block_d256": (lambda: tg.Block(256, 4),
                           lambda: (torch.randn(8, 128, 256), torch.randn(8, 128, 256))),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="25")
    ap.add_argument("--policies", default="fp32,torch_autocast_cpu,mixed_bf16,pure_bf16,custom_lowered_norms")
    args = ap.parse_args()
    tg.workloads = workloads
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tg.main(["--steps", args.steps, "--policies", args.policies, "--models", "resnet_small,gpt_block_d256"],
            device="cpu", out_name="torch_cpu.json")
