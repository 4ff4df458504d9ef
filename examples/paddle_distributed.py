"""Data-parallel Paddle training under the team's unimp policy (paddle.DataParallel, CPU gloo or GPU NCCL).

    python -m paddle.distributed.launch --nproc_per_node 2 examples/paddle_distributed.py [policy.toml]
    python examples/paddle_distributed.py                      # one process works too (world size 1)

Order, as Paddle requires (decorate before DataParallel): ``amp = unimp.apply(policy, layer, opt)``
then ``model = amp.data_parallel()``. Each rank trains on its shard of the global batch; rank 1
alone gets an inf gradient at step 3 (``--no-inject`` turns it off): every rank skips that step and
keeps the same loss scale, because ``amp.optimizer.step()`` agrees the found-inf flag across ranks.
Gradients are all-reduced in ``policy.distributed.reduce_dtype`` (here bfloat16, by unimp, since
the CPU grads are float32). On CPU the policy runs with on_unsupported = "fallback" (Paddle's
dygraph AMP is CUDA-only; the Plan says what runs in float32). Per-rank output is in the launch
log directory (``log/workerlog.N``); rank 0 also prints to the terminal.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")
warnings.filterwarnings("ignore", message="amp_guard can only be enabled")
warnings.filterwarnings("ignore", message="The program will return to single-card")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402

import unimp  # noqa: E402

HERE = Path(__file__).resolve().parent
GLOBAL_BATCH, STEPS, INJECT_AT = 64, 8, 3


def main(path: str | None = None, inject: bool = True) -> None:
    if int(os.environ.get("PADDLE_TRAINERS_NUM", "1")) > 1:
        dist.init_parallel_env()  # gloo on CPU, NCCL on GPU (set up by paddle.distributed.launch)
    rank, nranks = dist.get_rank(), dist.get_world_size()
    team = HERE / "team_policy.toml"
    policy = unimp.load(path or (str(team) if team.exists() else "mixed_bf16"))
    # for the demo: reduce in bfloat16 and dynamic loss scaling (the team file keeps its other choices)
    policy = policy.replace(distributed={"reduce_dtype": "bfloat16"}, loss_scale={
        "mode": "dynamic", "initial": 1024.0, "growth_interval": 4, "skip_nonfinite": True})
    if not paddle.device.get_device().startswith("gpu"):
        policy = policy.replace(on_unsupported="fallback")

    paddle.seed(0)  # same init everywhere (DataParallel also broadcasts rank 0's params)
    layer = paddle.nn.Sequential(paddle.nn.Linear(64, 128), paddle.nn.ReLU(), paddle.nn.LayerNorm(128),
                                 paddle.nn.Linear(128, 8))
    optimizer = paddle.optimizer.Adam(learning_rate=1e-2, parameters=layer.parameters())
    amp = unimp.apply(policy, layer, optimizer)   # 1. the policy (Paddle's decorate step)
    model = amp.data_parallel()                   # 2. then paddle.DataParallel, told to unimp
    if rank == 0:
        print(amp.plan)
        print("data_parallel:", amp.native["data_parallel"])

    rng = np.random.default_rng(0)
    x_all = rng.normal(size=(GLOBAL_BATCH, 64)).astype("float32")
    y_all = (rng.normal(size=(GLOBAL_BATCH,)) > 0).astype("int64") * 3
    n = GLOBAL_BATCH // nranks
    x = paddle.to_tensor(x_all[rank * n:(rank + 1) * n])
    y = paddle.to_tensor(y_all[rank * n:(rank + 1) * n])
    for step in range(STEPS):
        loss = paddle.nn.functional.cross_entropy(model(x).astype("float32"), y)
        amp.backward(loss)
        if inject and step == INJECT_AT and rank == min(1, nranks - 1):
            g = layer[0].weight.grad.numpy()
            g[0, 0] = np.inf  # only this rank's gradient overflows
            layer[0].weight.grad.set_value(g)
        skipped = amp.optimizer.step()
        amp.optimizer.clear_grad()
        print(f"rank {rank} step {step} loss {float(loss.numpy()):.4f} skipped {skipped} scale {amp.scale:g}",
              flush=True)
    checksum = float(sum(float(p.numpy().astype("float64").sum()) for p in layer.parameters()))
    print(f"rank {rank}: skipped {amp.skipped_steps} steps, scale {amp.scale:g}, params checksum {checksum:.10f}")
    amp.remove()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--no-inject"]
    main(args[0] if args else None, inject="--no-inject" not in sys.argv)
