"""DDP and FSDP2 under one policy, on 2 real CPU processes (gloo).

``dist_worker.py`` runs every scenario once in a 2-rank spawn (~15 s here); the assertions are
made here against single-process runs of the same global batch and against the core's LossScale
reference. Tolerances (relative, on the loss of each of 6 steps): fp32 policy 1e-6 (only the
reduction order differs); bf16 policies 2**-8 (autocast rounds each rank's weight gradients to
bfloat16 before they are summed, so half-batch sums round differently from the full batch).
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import unimp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dist_worker as W  # noqa: E402

POISONED = (1, 3)  # step 1: rank 1's loss * inf; step 3: one element of rank 1's reduced grad = inf


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(HERE, "dist_worker.py"), str(out), _port()],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(W.WORLD)]
    for r in res:
        assert "error" not in r, r["error"]
    return res


def single(policy, opt, poison=()) -> list[float]:
    """The same training on one process with the whole global batch."""
    m = W.model()
    amp = unimp.apply(policy, m, opt(m.parameters()))
    xs, ys = W.data()
    losses = []
    for i in range(W.STEPS):
        loss = F.mse_loss(amp.model(xs[i]), ys[i])
        amp.backward(loss * float("inf") if i in poison else loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(float(loss.detach()))
    amp.remove()
    return losses


def global_losses(ranks, key) -> list[float]:
    return [sum(r[key]["loss"][i] for r in ranks) / len(ranks) for i in range(W.STEPS)]


def close(got, want, rtol):
    for i, (a, b) in enumerate(zip(got, want)):
        if math.isfinite(b):
            assert abs(a - b) <= rtol * abs(b), f"step {i}: {a} vs single-process {b} (rtol {rtol})"


def same_params_everywhere(ranks, key):
    for step in range(W.STEPS):
        for a, b in zip(ranks[0][key]["params"][step], ranks[1][key]["params"][step]):
            assert torch.equal(a, b), f"{key}: ranks hold different parameters after step {step}"


# ------------------------------------------------------------------------------------- (1) DDP losses
@pytest.mark.parametrize("policy,rtol", [("fp32", 1e-6), ("mixed_bf16", 2**-8)])
def test_ddp_losses_match_single_process(ranks, policy, rtol):
    close(global_losses(ranks, f"ddp_{policy}"), single(policy, W.sgd), rtol)
    same_params_everywhere(ranks, f"ddp_{policy}")
    assert ranks[0][f"ddp_{policy}_info"]["all_reduce"].startswith("DDP default")  # fp32 grads: no hook


def test_ddp_first_order_is_the_same_training(ranks):
    """unimp.apply(policy, DDP(model)) == amp.ddp() for a policy that keeps parameter dtypes."""
    for r in ranks:
        assert r["ddp_first_mixed_bf16"]["loss"] == r["ddp_mixed_bf16"]["loss"]


def test_wrong_order_is_refused_with_the_fix(ranks):
    msg = ranks[0]["wrong_order"]
    assert msg and msg.startswith("UnsupportedError") and "amp.ddp(" in msg and "0.weight" in msg


# ------------------------------------------------------------------------------ (2) overflow on rank 1
def reference_trajectory(policy) -> tuple[list[float], list[int]]:
    rule, st = unimp.LossScale(policy.loss_scale), unimp.LossScale(policy.loss_scale).initial_state()
    scales, skipped = [], []
    for i in range(W.STEPS):
        st = rule.update(st, i not in POISONED).state
        scales.append(st.scale)
        skipped.append(st.skipped)
    return scales, skipped


@pytest.mark.parametrize("key", ["ddp_overflow_adam", "ddp_overflow_adamw_fused",
                                 "fsdp_overflow_adam", "fsdp_overflow_adamw_fused"])
def test_overflow_on_one_rank_skips_on_every_rank(ranks, key):
    if key.startswith("fsdp") and "fsdp_skip" in ranks[0]:
        pytest.skip(ranks[0]["fsdp_skip"])
    scales, skipped = reference_trajectory(W.scaled_policy())
    assert skipped[-1] == len(POISONED)
    for r in ranks:
        assert r[key]["scale"] == scales and r[key]["skipped"] == skipped
    same_params_everywhere(ranks, key)
    params = ranks[0][key]["params"]
    for step in POISONED:  # the skipped step changed no bit
        assert all(torch.equal(a, b) for a, b in zip(params[step], params[step - 1]))
    assert not all(torch.equal(a, b) for a, b in zip(params[2], params[1]))  # a clean step moves
    opt = ((lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)) if key.endswith("fused")
           else (lambda ps: torch.optim.Adam(ps, lr=1e-2)))
    # rank 1's post-reduce grad poison (step 3) has no single-process twin: compare the steps before
    want = single(W.scaled_policy(), opt, poison=(1,))
    close(global_losses(ranks, key)[:4], want[:4], 2**-8)


# ------------------------------------------------------------------------------ (3) bf16 reduction
def test_reduce_dtype_bfloat16_really_reduces_in_bfloat16(ranks):
    """Expected: torch's bf16 compress semantics, per rank bf16(g_r) / 2, summed in bf16."""
    xs, ys = W.data()
    local = []
    for r in range(W.WORLD):
        m = W.model()
        F.mse_loss(m(W.shard(xs[0], r)), W.shard(ys[0], r)).backward()
        local.append([p.grad for p in m.parameters()])
    assert ranks[0]["bf16_reduce_info"]["reduce_dtype"] == "bfloat16"
    for i, (g0, g1) in enumerate(zip(*local)):
        want = (g0.to(torch.bfloat16) / 2 + g1.to(torch.bfloat16) / 2).float()
        fp32_mean = (g0 + g1) / 2
        assert not torch.equal(want, fp32_mean)  # the test can tell the two reductions apart
        for r in ranks:
            assert torch.equal(r["bf16_reduce_grads"][i], want), f"param {i}: not a bfloat16 all-reduce"


def test_pure_bf16_ddp_masters_follow_rank_0_and_reduce_in_float32(ranks):
    """Ranks start from different weights; amp.ddp() broadcasts the fp32 masters like DDP's params."""
    assert ranks[0]["pure_bf16_info"]["all_reduce"].startswith("unimp comm hook")  # bf16 grads -> fp32
    for a, b in zip(ranks[0]["pure_bf16_masters"], ranks[1]["pure_bf16_masters"]):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    same_params_everywhere(ranks, "pure_bf16")
    close(global_losses(ranks, "pure_bf16"), single("pure_bf16", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
          2**-8)


# ---------------------------------------------------------------------------------------- (4) FSDP2
def test_fsdp_pure_bf16_units_and_sharded_masters(ranks):
    if "fsdp_skip" in ranks[0]:
        pytest.skip(ranks[0]["fsdp_skip"])
    r = ranks[0]
    # Linear units all-gather in bf16, the LayerNorm (float32 list) sits in a float32 unit
    assert r["fsdp_pure_bf16_mp"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32"]
    # masters: FSDP's fp32 shards, half of each parameter per rank
    assert r["fsdp_pure_bf16_dtypes"]["0.weight"] == ("torch.float32", 16 * 32 // 2)
    assert r["fsdp_info"]["found_inf"] == "all_reduce MAX over the mesh"
    same_params_everywhere(ranks, "fsdp_pure_bf16")
    close(global_losses(ranks, "fsdp_pure_bf16"),
          single("pure_bf16", lambda ps: torch.optim.AdamW(ps, lr=1e-2)), 2**-8)


def test_fsdp_fp8_layers_all_gather_in_fp8_and_train_like_one_process(ranks):
    """fully_shard with an FP8 policy: torchao's Float8Linear for the Plan's layers (fc 16->32; the 32->8
    head is not a multiple of 16), weights all-gathered in FP8; losses as one process's FP8 run."""
    if "fsdp_skip" in ranks[0] or "fsdp_fp8_skip" in ranks[0]:
        pytest.skip(ranks[0].get("fsdp_skip") or ranks[0]["fsdp_fp8_skip"])
    r = ranks[0]
    assert r["fsdp_fp8_layers"] == {"0": "tensorwise"}
    assert r["fsdp_fp8_weights"] == {"0": "WeightWithDynamicFloat8CastTensor"}
    same_params_everywhere(ranks, "fsdp_fp8")
    # FP8 (not derived, kept as is; issue 27): 2**-6, four times bf16's 2**-8 (each rank's FP8 scales
    # come from its half batch); e4m3's own u = 2**-4 would pass a broken recipe
    close(global_losses(ranks, "fsdp_fp8"), single(W.FP8_POLICY, lambda ps: torch.optim.AdamW(ps, lr=1e-2)), 2**-6)


def test_fsdp_model_sharded_against_the_policy_is_refused(ranks):
    if "fsdp_skip" in ranks[0]:
        pytest.skip(ranks[0]["fsdp_skip"])
    msg = ranks[0]["fsdp_mismatch"]
    assert msg and msg.startswith("UnsupportedError") and "0.weight: param_dtype bfloat16 (policy: float32)" in msg
    assert "unimp_torch.fully_shard" in msg


def test_mixed_precision_policy_is_compiled_from_the_policy():
    import unimp_torch

    pol = unimp.load("mixed_fp16").replace(distributed={"reduce_dtype": "bfloat16"}, output_dtype="bfloat16")
    mp = unimp_torch.mixed_precision_policy(pol, root=True)
    assert (mp.param_dtype, mp.reduce_dtype, mp.output_dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert unimp_torch.mixed_precision_policy(pol, "float16").output_dtype is None
    # "unchanged": the root casts nothing (FSDP's own default output_dtype=None), "float32" casts
    mp = unimp_torch.mixed_precision_policy
    assert mp(pol.replace(output_dtype="unchanged"), root=True).output_dtype is None
    assert mp(pol.replace(output_dtype="float32"), root=True).output_dtype == torch.float32


def test_ddp_without_process_group_is_a_clear_error():
    m = W.model()
    amp = unimp.apply("mixed_bf16", m, W.sgd(m.parameters()))
    with pytest.raises(RuntimeError, match="init_process_group"):
        amp.ddp()
    amp.remove()
