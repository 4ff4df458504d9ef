"""Data-parallel torch training under the team's unimp policy: DDP (default) or FSDP2, CPU gloo or GPU NCCL.

    python examples/torch_ddp.py                                   # 2 CPU processes (gloo), spawned here
    python examples/torch_ddp.py --fsdp                            # same, FSDP2 (fully_shard) instead of DDP
    torchrun --nproc_per_node 2 examples/torch_ddp.py [--fsdp]     # under torchrun (GPUs: NCCL)
    python examples/torch_ddp.py --policy policies/x.toml --no-inject

Order: ``amp = unimp.apply(policy, model, opt)`` then ``model = amp.ddp()`` (DDP after unimp, so
DDP reduces the parameters the policy gives the model). FSDP2: ``unimp_torch.fully_shard(model,
policy, units=Block)``, then the optimizer, then ``unimp.apply``. Each rank trains on its half of
the global batch; rank 1 alone gets an inf gradient at step 3 (``--no-inject`` turns it off):
every rank skips that step and keeps the same loss scale. Gradients are all-reduced in
``policy.distributed.reduce_dtype`` (bfloat16 here, by a DDP comm hook / FSDP's reduce-scatter).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import unimp

GLOBAL_BATCH, STEPS, INJECT_AT, D = 32, 8, 3, 64

# the team's policy, for this demo with dynamic loss scaling so a skipped step shows
POLICY = {"name": "team-ddp-demo", "extends": "mixed_bf16",
          "loss_scale": {"mode": "dynamic", "skip_nonfinite": True, "initial": 1024.0, "growth_interval": 2},
          "distributed": {"reduce_dtype": "bfloat16"}}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.norm(x))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, D), Block(D), Block(D), nn.LayerNorm(D), nn.Linear(D, 8))


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    policy = unimp.load(args.policy or POLICY)
    m = model().to(device)
    if args.fsdp:
        import unimp_torch

        unimp_torch.fully_shard(m, policy, units=Block)  # a unit per Block, then the root
        amp = unimp.apply(policy, m, torch.optim.AdamW(m.parameters(), lr=3e-3))
    else:
        amp = unimp.apply(policy, m, torch.optim.AdamW(m.parameters(), lr=3e-3))
        amp.ddp(device_ids=[rank] if device != "cpu" else None)
    if rank == 0:
        print(f"{world} ranks, {amp.distributed}")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 8, (GLOBAL_BATCH,), generator=g)
    n = GLOBAL_BATCH // world
    x, y = x[rank * n:(rank + 1) * n].to(device), y[rank * n:(rank + 1) * n].to(device)
    for step in range(STEPS):
        loss = F.cross_entropy(amp.model(x), y)
        amp.backward(loss)
        if args.inject and step == INJECT_AT and rank == 1:  # this rank's gradient only
            grad = next(p.grad for p in amp.model.parameters() if p.grad is not None)
            getattr(grad, "_local_tensor", grad).view(-1)[0] = float("inf")
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        seen = [None] * world
        dist.all_gather_object(seen, (round(float(loss.detach()), 4), amp.scale, amp.skipped_steps))
        if rank == 0:
            print(f"step {step}: (loss, scale, skipped) per rank {seen}")
    if rank == 0:
        print(amp.report())
    amp.remove()


def worker(rank: int, world: int, port: str, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", help="a policy file or preset (default: mixed_bf16 + scaling, bf16 reduce)")
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--no-inject", dest="inject", action="store_false", help="no inf gradient on rank 1")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn when not under torchrun")
    args = ap.parse_args()
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    torch.set_num_threads(1)
    mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)


if __name__ == "__main__":
    main()
