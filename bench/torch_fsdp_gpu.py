"""FSDP2 training step: hand-written ``fully_shard(mp_policy=MixedPrecisionPolicy(...))`` vs unimp's FSDP path.

    torchrun --nproc_per_node 1 bench/torch_fsdp_gpu.py     # one H200: GPT block d2048 T2048 b8, NCCL
    python3 bench/torch_fsdp_gpu.py                          # same; initialises a 1-rank group itself
    python3 bench/torch_fsdp_gpu.py --smoke                  # tiny shapes, CPU + gloo (checks the script)

The block trains under ``mixed_bf16`` (``--policies mixed_bf16,pure_bf16`` adds the bf16-params
preset). Native is what a careful user writes by hand for the same policy: ``fully_shard`` with a
``MixedPrecisionPolicy`` (param dtype as the policy's, ``reduce_dtype`` float32, the policy's output dtype:
none for ``"unchanged"``;
for ``pure_bf16`` the two LayerNorms as float32 units of their own), ``torch.autocast(bf16)``
around the forward, fused AdamW. unimp: ``unimp_torch.fully_shard(model, policy)`` +
``unimp.apply(policy, model, opt)`` and the training loop of docs/design.md. Both models alive, interleaved rounds
of steps in alternating order, CUDA events, median of >= 20 steps each after warm-up. Prints the
ratio (contract <= 1.01) and writes ``$OUT/torch_fsdp_gpu.json`` when ``OUT`` is set.
NVLink multicast is left off (``NCCL_NVLS_ENABLE=0``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import unimp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_gpu

# ---------------------------------------------------------------------------------- model, process group


class Block(torch_gpu.Block):
    """bench/torch_gpu.py's GPT-style block with plain nn.LayerNorm (FSDP2 shards per Block)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__(d, heads, norm=nn.LayerNorm)


def shapes(smoke: bool) -> dict[str, int]:
    return dict(d=64, heads=4, t=32, b=2) if smoke else dict(d=2048, heads=16, t=2048, b=8)


def init(smoke: bool) -> tuple[str, int, int]:
    """Join the torchrun group, or make a 1-rank one; returns (device, rank, world)."""
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if "RANK" not in os.environ:  # plain python: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if device == "cuda":
            dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo")
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    return device, dist.get_rank(), dist.get_world_size()


def build(s: dict[str, int], device: str) -> nn.Module:
    torch.manual_seed(0)
    return Block(s["d"], s["heads"]).to(device)


def batch(s: dict[str, int], device: str, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1 + rank)
    shape = (s["b"], s["t"], s["d"])
    return (torch.randn(shape, device=device, generator=g), torch.randn(shape, device=device, generator=g))


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def policy_of(name: str, reduce_dtype: str = "float32") -> unimp.Policy:
    return unimp.load(name).replace(distributed={"reduce_dtype": reduce_dtype})


# ---------------------------------------------------------------------------------- the two steps

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Step = Callable[[torch.Tensor, torch.Tensor], None]


def native_fsdp(policy: unimp.Policy, model: nn.Module, device: str) -> Step:
    """The hand-written FSDP2 step for ``policy`` (mixed_bf16 / pure_bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reduce = DT[policy.distributed.reduce_dtype]
    low = DT[policy.compute_dtype]
    if policy.param_dtype != "float32":  # bf16 params: the norms stay float32, each its own unit
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce,
                                                              cast_forward_inputs=False))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=DT[policy.param_dtype], reduce_dtype=reduce,
                                                      output_dtype=DT[policy.output_cast] if policy.output_cast
                                                      else None, cast_forward_inputs=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device, dtype=low):
            out = model(x)
        loss_of(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def unimp_fsdp(policy: unimp.Policy, model: nn.Module) -> tuple[Step, Any]:
    import unimp_torch

    unimp_torch.fully_shard(model, policy)
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        amp.backward(loss_of(amp.model(x), y))
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    return step, amp


# ---------------------------------------------------------------------------------- timing


timed = torch_gpu._timed  # one timing harness for every torch bench (CUDA events / perf_counter)
to_ms = torch_gpu._ms


def interleaved(runs: dict[str, Callable[[], Any]], warmup: int, steps: int, rounds: int = 6) -> dict[str, float]:
    """Median ms per variant: warm-up, then ``rounds`` blocks of steps, the order rotating per round."""
    for _ in range(warmup):
        for run in runs.values():
            run()
    names = list(runs)
    per = max(steps // rounds + (steps % rounds > 0), 4)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            samples[n] += to_ms([runs[n]() for _ in range(per)])
    if dist.is_initialized() and dist.get_world_size() > 1:  # a step is as slow as its slowest rank
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, {n: statistics.median(v) for n, v in samples.items()})
        return {n: max(o[n] for o in out) for n in names} | {"steps": len(samples[names[0]])}
    return {n: statistics.median(v) for n, v in samples.items()} | {"steps": len(samples[names[0]])}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with gloo")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant (>= 20)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--policies", default="mixed_bf16")
    args = ap.parse_args(argv)
    device, rank, world = init(args.smoke)
    s = shapes(args.smoke)
    x, y = batch(s, device, rank)
    rows = []
    for name in args.policies.split(","):
        policy = policy_of(name)
        nat = timed(native_fsdp(policy, build(s, device), device), x, y, device)
        step, amp = unimp_fsdp(policy, build(s, device))
        ours = timed(step, x, y, device)
        r = interleaved({"native": nat, "unimp": ours}, args.warmup, max(args.steps, 20))
        r.update(policy=name, ratio=r["unimp"] / r["native"], mp=str(amp.distributed))
        rows.append(r)
        del nat, ours, step, amp
        if device == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        dev = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(f"\nFSDP2 GPT block d={s['d']} T={s['t']} b={s['b']}, world {world}, torch {torch.__version__}, "
              f"{dev}, median of {rows[0]['steps']} steps after {args.warmup} warm-up\n")
        print("| policy | native ms | unimp ms | unimp/native (<= 1.01) |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['policy']} | {r['native']:.2f} | {r['unimp']:.2f} | {r['ratio']:.3f} |")
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "torch_fsdp_gpu.json"), "w") as f:
                json.dump({"torch": torch.__version__, "device": dev, "world": world, "shapes": s,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
