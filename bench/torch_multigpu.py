"""Multi-GPU: DDP and FSDP2 under ``mixed_bf16``, reduce in float32 and in bfloat16, native vs unimp.

    torchrun --nproc_per_node 2 bench/torch_multigpu.py             # 2 GPUs, NCCL (NVLS off)
    torchrun --nproc_per_node 2 bench/torch_multigpu.py --smoke     # tiny shapes, CPU + gloo

GPT-style block (d=2048, T=2048, batch 8 per GPU). Per config (engine x reduce_dtype):
native = what a careful user writes (DDP + ``bf16_compress_hook`` when reducing in bf16 /
``fully_shard`` with ``MixedPrecisionPolicy(reduce_dtype=...)``, autocast bf16, fused AdamW);
unimp = ``amp.ddp()`` / ``unimp_torch.fully_shard`` + ``unimp.apply`` with the policy's
``[distributed] reduce_dtype``. Interleaved rounds, median of >= 20 steps (the slower rank's),
ratio (contract <= 1.01) and weak-scaling efficiency = 1-GPU step / 2-GPU step at the same per-GPU
batch (the 1-GPU step: unimp mixed_bf16 without any process group, timed on rank 0 alone).

Then the skip agreement: under mixed_bf16 + dynamic loss scaling, one element of rank 1's
(reduced) gradient is set to inf at step 2 only; every rank must skip that step, hold the core
reference's scales and identical parameters. ``$OUT/torch_multigpu.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import torch.distributed as dist
import torch_fsdp_gpu as common
from torch import nn

import unimp

DT = common.DT


def _gloo_bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook body (the hook itself refuses gloo)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def native_ddp(policy: unimp.Policy, model: nn.Module, device: str, rank: int) -> common.Step:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[rank] if device == "cuda" else None)
    if policy.distributed.reduce_dtype == "bfloat16":  # torch's hook; it refuses gloo, so CPU uses its body
        hook = default_hooks.bf16_compress_hook if device == "cuda" else _gloo_bf16_hook
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            out = ddp(x)
        common.loss_of(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def unimp_ddp(policy: unimp.Policy, model: nn.Module, device: str, rank: int) -> tuple[common.Step, Any]:
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    amp.ddp(device_ids=[rank] if device == "cuda" else None)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        amp.backward(common.loss_of(amp.model(x), y))
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    return step, amp


def single_gpu_ms(s: dict[str, int], device: str, x: torch.Tensor, y: torch.Tensor, args: Any) -> float:
    """unimp mixed_bf16 on this device alone (no DDP/FSDP): the 1-GPU reference step."""
    model = common.build(s, device)
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))

    def step(a: torch.Tensor, b: torch.Tensor) -> None:
        amp.backward(common.loss_of(amp.model(a), b))
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    run = common.timed(step, x, y, device)
    for _ in range(args.warmup):
        run()
    ms = common.to_ms([run() for _ in range(max(args.steps, 20))])
    amp.remove()
    import statistics

    return statistics.median(ms)


def skip_agreement(engine: str, s: dict[str, int], device: str, rank: int) -> dict[str, Any]:
    """Overflow on rank 1 only (step 2): both ranks skip, same scales as the reference, same params."""
    import unimp_torch

    policy = unimp.load("mixed_bf16").replace(
        loss_scale={"mode": "dynamic", "skip_nonfinite": True, "initial": 1024.0, "growth_interval": 2})
    model = common.build(s, device)
    if engine == "fsdp2":
        unimp_torch.fully_shard(model, policy)
        amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    else:
        amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
        amp.ddp(device_ids=[rank] if device == "cuda" else None)
    x, y = common.batch(s, device, rank)
    poison, n = 2, 5
    scales, skipped, moved = [], [], []
    for i in range(n):
        amp.backward(common.loss_of(amp.model(x), y))
        if i == poison and rank == 1:
            g = next(p.grad for p in amp.model.parameters() if p.grad is not None)
            getattr(g, "_local_tensor", g).view(-1)[0] = float("inf")
        before = [p.detach().clone() for p in amp.model.parameters()]
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        moved.append(any(not torch.equal(a, p) for a, p in zip(before, amp.model.parameters())))
        st = amp.loss_scale_state()
        scales.append(st.scale)
        skipped.append(st.skipped)
    with torch.no_grad():  # parameters (all shards) identical across ranks?
        flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().view(-1)
                          for p in amp.model.parameters()])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (scales, skipped, moved))
    rule = unimp.LossScale(policy.loss_scale)
    st, ref = rule.initial_state(), []
    for i in range(n):
        st = rule.update(st, i != poison).state
        ref.append((st.scale, st.skipped))
    ok = (all(o == seen[0] for o in seen) and [(a, b) for a, b in zip(scales, skipped)] == ref
          and all(not o[2][poison] for o in seen) and all(torch.equal(everyone[0], e) for e in everyone))
    amp.remove()
    return {"engine": engine, "scales": scales, "skipped": skipped, "moved_per_step": [o[2] for o in seen],
            "reference": ref, "agreed": ok}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU with gloo")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--engines", default="ddp,fsdp2")
    ap.add_argument("--reduce", default="float32,bfloat16")
    args = ap.parse_args(argv)
    device, rank, world = common.init(args.smoke)
    if world < 2:
        raise SystemExit("bench/torch_multigpu.py needs 2 ranks: torchrun --nproc_per_node 2 bench/torch_multigpu.py"
                         " [--smoke for CPU/gloo]")
    s = common.shapes(args.smoke)
    x, y = common.batch(s, device, rank)
    with warnings.catch_warnings():  # rank 0 alone, on purpose: not data-parallel
        warnings.simplefilter("ignore", unimp.UnimpWarning)
        one = single_gpu_ms(s, device, x, y, args) if rank == 0 else 0.0
    dist.barrier()
    rows = []
    for engine in args.engines.split(","):
        for reduce in args.reduce.split(","):
            policy = common.policy_of("mixed_bf16", reduce)
            if engine == "ddp":
                nat = native_ddp(policy, common.build(s, device), device, rank)
                ours, amp = unimp_ddp(policy, common.build(s, device), device, rank)
            else:
                nat = common.native_fsdp(policy, common.build(s, device), device)
                ours, amp = common.unimp_fsdp(policy, common.build(s, device))
            r = common.interleaved({"native": common.timed(nat, x, y, device),
                                    "unimp": common.timed(ours, x, y, device)}, args.warmup, max(args.steps, 20))
            r.update(engine=engine, reduce_dtype=reduce, ratio=r["unimp"] / r["native"],
                     efficiency=one / r["unimp"] if rank == 0 else None, how=amp.distributed)
            rows.append(r)
            if rank == 0:
                print(f"{engine:5s} reduce {reduce:8s} native {r['native']:8.2f} ms  unimp {r['unimp']:8.2f} ms  "
                      f"ratio {r['ratio']:.3f}", flush=True)
            amp.remove()
            del nat, ours, amp
            if device == "cuda":
                torch.cuda.empty_cache()
    agreement = [skip_agreement(e, s, device, rank) for e in args.engines.split(",")]
    result = {"torch": torch.__version__, "world": world, "shapes": s, "one_gpu_ms": one, "rows": rows,
              "skip_agreement": agreement}
    if rank == 0:
        dev = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        print(f"\n{world} x {dev}, torch {torch.__version__}, GPT block d={s['d']} T={s['t']} b={s['b']} per rank, "
              f"mixed_bf16, median of {rows[0]['steps']} steps (slower rank); 1 rank alone: {one:.2f} ms\n")
        print("| engine | reduce_dtype | native ms | unimp ms | unimp/native (<= 1.01) | scaling efficiency (unimp) |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['engine']} | {r['reduce_dtype']} | {r['native']:.2f} | {r['unimp']:.2f} | {r['ratio']:.3f} | "
                  f"{r['efficiency']:.2f} |")
        for a in agreement:
            print(f"\noverflow on rank 1 at step 2 ({a['engine']}): scales {a['scales']}, skipped {a['skipped']}, "
                  f"reference {a['reference']}, params moved per step per rank {a['moved_per_step']} -> "
                  f"{'AGREED' if a['agreed'] else 'DISAGREED'}")
        if os.environ.get("OUT"):
            result["device"] = dev
            with open(os.path.join(os.environ["OUT"], "torch_multigpu.json"), "w") as f:
                json.dump(result, f, indent=1, default=str)
    dist.destroy_process_group()
    if not all(a["agreed"] for a in agreement):
        raise SystemExit("skip agreement failed")
    return result


if __name__ == "__main__":
    main()
