"""2-rank gloo worker for test_distributed.py: ``python dist_worker.py OUTDIR [PORT]``.

Spawns two CPU processes (gloo), runs every DDP / FSDP2 scenario once and pickles what each rank
saw to OUTDIR/rank{r}.pt; the assertions (against single-process runs and the core's LossScale
reference) are made by the test, not here. One spawn for all scenarios keeps the suite fast.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

WORLD = 2
GLOBAL_BATCH = 8
STEPS = 6


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 8))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, GLOBAL_BATCH, 16, generator=g), torch.randn(STEPS, GLOBAL_BATCH, 8, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def scaled_policy(**distributed):
    import unimp

    # mixed_bf16 + dynamic scaling (growth every 2 finite steps) so skips and scale changes show
    return unimp.load("mixed_bf16").replace(
        loss_scale={"mode": "dynamic", "skip_nonfinite": True, "initial": 1024.0, "growth_interval": 2},
        distributed=distributed or {"reduce_dtype": "float32"})


FP8_POLICY = {"extends": "fp8_tensorwise", "layout": {"on_misaligned": "ignore"}}


def shard(t: torch.Tensor, rank: int) -> torch.Tensor:
    n = t.shape[0] // WORLD
    return t[rank * n:(rank + 1) * n]


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def train(amp, rank: int, poison: dict[int, str], inject) -> dict:
    """STEPS steps on this rank's half of the global batch; ``poison[step]`` in {'loss', 'grad'}."""
    xs, ys = data()
    out = {"loss": [], "scale": [], "skipped": [], "params": []}
    for i in range(STEPS):
        loss = F.mse_loss(amp.model(shard(xs[i], rank)), shard(ys[i], rank))
        bad = poison.get(i) if rank == 1 else None
        amp.backward(loss * float("inf") if bad == "loss" else loss)
        if bad == "grad":  # after the all-reduce / reduce-scatter: this rank's gradient only
            inject(amp)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        out["loss"].append(float(loss.detach()))
        st = amp.loss_scale_state()
        out["scale"].append(st.scale)
        out["skipped"].append(st.skipped)
        out["params"].append([full(p) for p in amp.model.parameters()])
    return out


def poison_first_grad(amp) -> None:
    g = next(p.grad for p in amp.model.parameters() if p.grad is not None)
    local = getattr(g, "_local_tensor", g)
    local.view(-1)[0] = float("inf")


def run_ddp(rank: int, res: dict) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import unimp

    # (1) losses vs single process: amp.ddp() order and DDP-first order, mixed_bf16 (float32 reduce)
    for policy in ("fp32", "mixed_bf16"):
        m = model()
        amp = unimp.apply(policy, m, sgd(m.parameters()))
        amp.ddp()
        res[f"ddp_{policy}"] = train(amp, rank, {}, None)
        res[f"ddp_{policy}_info"] = dict(amp.distributed)
        amp.remove()
    m = model()
    amp = unimp.apply("mixed_bf16", DDP(m), sgd(m.parameters()))
    res["ddp_first_mixed_bf16"] = train(amp, rank, {}, None)
    amp.remove()
    # (2) overflow on rank 1 only: a poisoned loss (step 1) and a poisoned post-all-reduce grad (step 3)
    for name, opt in (("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
                      ("adamw_fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True))):
        m = model()
        amp = unimp.apply(scaled_policy(), m, opt(m.parameters()))
        amp.ddp()
        res[f"ddp_overflow_{name}"] = train(amp, rank, {1: "loss", 3: "grad"}, poison_first_grad)
        amp.remove()
    # (3) reduce_dtype = bfloat16 (fp32 params and grads, fp32 policy): the reduced grads, raw
    import unimp as u

    pol = u.load("fp32").replace(distributed={"reduce_dtype": "bfloat16"})
    m = model()
    amp = u.apply(pol, m, torch.optim.SGD(m.parameters(), lr=0.0))
    amp.ddp()
    xs, ys = data()
    amp.backward(F.mse_loss(amp.model(shard(xs[0], rank)), shard(ys[0], rank)))
    res["bf16_reduce_grads"] = [p.grad.detach().clone() for p in m.parameters()]
    res["bf16_reduce_info"] = dict(amp.distributed)
    amp.remove()
    # pure_bf16 via amp.ddp(): ranks start from different weights; masters follow rank 0
    m = model(seed=rank)
    amp = unimp.apply("pure_bf16", m, torch.optim.AdamW(m.parameters(), lr=1e-2))
    amp.ddp()
    res["pure_bf16"] = train(amp, rank, {}, None)
    res["pure_bf16_masters"] = [mst.detach().clone() for _, _, mst in amp.master_weights]
    res["pure_bf16_info"] = dict(amp.distributed)
    amp.remove()
    # wrong order refused: DDP built first under a policy that swaps parameters
    m = model()
    try:
        unimp.apply("pure_bf16", DDP(m), torch.optim.AdamW(m.parameters()))
        res["wrong_order"] = None
    except Exception as e:
        res["wrong_order"] = f"{type(e).__name__}: {e}"


def run_fsdp(rank: int, res: dict) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import unimp
    import unimp_torch

    for name, opt in (("adamw_fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
                      ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2))):
        m = unimp_torch.fully_shard(model(), scaled_policy(), units=nn.Linear)
        amp = unimp.apply(scaled_policy(), m, opt(m.parameters()))
        res[f"fsdp_overflow_{name}"] = train(amp, rank, {1: "loss", 3: "grad"}, poison_first_grad)
        res["fsdp_info"] = dict(amp.distributed)
    # pure_bf16: bf16 units for Linear, float32 unit for LayerNorm; sharded fp32 masters
    m = unimp_torch.fully_shard(model(), "pure_bf16", units=nn.Linear)
    amp = unimp.apply("pure_bf16", m, torch.optim.AdamW(m.parameters(), lr=1e-2))
    res["fsdp_pure_bf16"] = train(amp, rank, {}, None)
    res["fsdp_pure_bf16_dtypes"] = {n: (str(p.dtype), p.to_local().numel()) for n, p in m.named_parameters()}
    groups = [mm._get_fsdp_state()._fsdp_param_group for mm in m.modules() if hasattr(mm, "_get_fsdp_state")]
    res["fsdp_pure_bf16_mp"] = sorted(str(g.mp_policy.param_dtype) for g in groups if g is not None)
    # FP8 (torchao, CPU emulation): Float8Linear layers made before sharding, weights all-gathered in FP8
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        res["fsdp_fp8_skip"] = "torchao is not installed"
    else:
        m = unimp_torch.fully_shard(model(), FP8_POLICY, units=nn.Linear)
        amp = unimp.apply(FP8_POLICY, m, torch.optim.AdamW(m.parameters(), lr=1e-2))
        res["fsdp_fp8"] = train(amp, rank, {}, None)
        res["fsdp_fp8_layers"] = amp.fp8_layers
        res["fsdp_fp8_weights"] = {p: type(mod.weight._local_tensor).__name__ for p, mod in m.named_modules()
                                   if isinstance(mod, Float8Linear)}
    # a hand-sharded model whose MixedPrecisionPolicy contradicts the policy: refused, named
    m = model()
    fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    try:
        unimp.apply("mixed_bf16", m, torch.optim.AdamW(m.parameters()))
        res["fsdp_mismatch"] = None
    except Exception as e:
        res["fsdp_mismatch"] = f"{type(e).__name__}: {e}"


def worker(rank: int, outdir: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    res: dict = {}
    try:
        run_ddp(rank, res)
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401

            run_fsdp(rank, res)
        except ImportError as e:
            res["fsdp_skip"] = f"torch {torch.__version__} has no FSDP2: {e}"
    except Exception:
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "29541"), nprocs=WORLD)
