"""paddle.DataParallel under one policy: 2 real CPU processes (gloo) + single-process checks.

The 2-process part runs ``python -m paddle.distributed.launch --nproc_per_node 2 dist_worker.py``
once per session (~10 s). If Paddle's CPU collective cannot start here (no probe result from the
workers), those tests skip with the workers' log tail as the reason; anything failing after the
probe is a failure. Expected scales/skips come from ``unimp.loss_scale.LossScale``; the loss
reference is the same model trained in this process with the whole global batch.
"""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import paddle
import pytest

import unimp
from unimp.errors import UnsupportedError
from unimp.loss_scale import LossScale

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import dist_worker as w  # noqa: E402

NRANKS = 2


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    logs = out / "logs"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(NRANKS),
           "--max_restart", "0", "--log_dir", str(logs), str(HERE / "dist_worker.py"), str(out)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        tail = proc.stdout[-1500:] + proc.stderr[-1500:]
    except subprocess.TimeoutExpired as e:
        proc, tail = None, f"timed out after {e.timeout}s"
    worker_logs = "".join(p.read_text()[-2000:] for p in sorted(logs.glob("workerlog.*"))) if logs.exists() else ""
    probes = [out / f"probe.{r}.json" for r in range(NRANKS)]
    if not all(p.exists() for p in probes):
        reason = (f"Paddle's CPU collective did not start with {NRANKS} processes ({' '.join(cmd[1:5])} "
                  f"...): {tail[-600:]} {worker_logs[-600:]}")
        print(reason)
        pytest.skip(reason)
    assert proc is not None and proc.returncode == 0, f"workers failed after the collective ran:\n{worker_logs}"
    ranks = [np.load(out / f"rank{r}.npz") for r in range(NRANKS)]
    meta = [json.loads((out / f"native.{r}.json").read_text()) for r in range(NRANKS)]
    probe = [json.loads(p.read_text()) for p in probes]
    return ranks, meta, probe


def test_two_ranks_match_one_process_with_the_global_batch(run2):
    ranks, meta, probe = run2
    assert [p["nranks"] for p in probe] == [2, 2] and probe[0]["sum"] == 3.0
    ref, _ = w.train(w.SCALED, 0, 1, distributed=False)  # one process, global batch 8
    global_loss = np.mean([r["parity_loss"] for r in ranks], axis=0)  # equal shards: mean of means
    np.testing.assert_allclose(global_loss, ref["loss"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ranks[0]["parity_after"], ref["after"], rtol=0, atol=1e-6)
    assert np.array_equal(ranks[0]["parity_after"], ranks[1]["parity_after"])  # bitwise, every step
    assert not ranks[0]["parity_skipped"].any()
    assert meta[0]["fp32"]["all_reduce"] == "paddle reducer" and meta[0]["fp32"]["nranks"] == 2


def test_overflow_on_rank_1_only_skips_the_step_on_both_ranks(run2):
    ranks, _, _ = run2
    rule = LossScale(unimp.load(w.SCALED).loss_scale)
    state, skips, scales = rule.initial_state(), [], []
    for step in range(w.STEPS):
        outcome = rule.update(state, step not in w.INJECT)
        state = outcome.state
        skips.append(outcome.skipped)
        scales.append(state.scale)
    assert any(skips) and not all(skips)
    for r in ranks:
        assert r["overflow_skipped"].tolist() == skips
        assert r["overflow_scale"].tolist() == scales
        assert int(r["overflow_skipped_steps"]) == sum(skips)
        for step, skipped in enumerate(skips):
            same = np.array_equal(r["overflow_before"][step], r["overflow_after"][step])
            assert same == skipped, f"step {step}: params {'changed' if skipped else 'unchanged'}"
    assert np.array_equal(ranks[0]["overflow_after"], ranks[1]["overflow_after"])


def _bf16(x):
    """float32 -> nearest bfloat16 (round to nearest even), as float32."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def _local_grads(rank):
    model, _ = w.build()
    x, y = w.shard(0, rank, NRANKS)
    paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y)).backward()
    return np.concatenate([p.grad.numpy().ravel() for p in model.parameters()])


def test_gradients_all_reduced_in_bfloat16(run2):
    ranks, meta, _ = run2
    assert meta[0]["bf16"]["reduce_dtype"] == "bfloat16"
    assert meta[0]["bf16"]["all_reduce"].startswith("unimp")
    g0, g1 = ranks[0]["bf16_grads"], ranks[1]["bf16_grads"]
    assert np.array_equal(g0, g1)
    l0, l1 = _local_grads(0), _local_grads(1)  # plain Paddle, no unimp, no collective
    mean32 = (l0 + l1) / 2
    assert (mean32.view(np.uint32) & 0xFFFF).any()  # a float32 reduce would leave these bits set
    assert not (g0.view(np.uint32) & 0xFFFF).any()  # every reduced grad is a bfloat16 value
    # each rank's grad rounded to bf16 (RNE), halved, summed and rounded to bf16 again: bit-exact
    expected = _bf16(_bf16(l0) * np.float32(0.5) + _bf16(l1) * np.float32(0.5))
    assert np.array_equal(g0, expected)


def test_gloo_float16_all_reduce_is_still_broken(run2):
    """Why reduce_dtype = float16 is refused on CPU; if this fails, Paddle fixed it: lift the refusal."""
    _, _, probe = run2
    assert all(p["fp16_sum"] == float("inf") for p in probe)


def test_paddle_data_parallel_by_hand_warns_on_every_rank(run2):
    _, meta, _ = run2
    assert all(len(m["manual_warnings"]) == 1 for m in meta)


# ---------------------------------------------------------------------- single process


def test_apply_on_a_data_parallel_is_refused_with_the_fix():
    model, opt = w.build()
    with pytest.warns(UserWarning, match="single-card"):
        dp = paddle.DataParallel(model)
    with pytest.raises(ValueError, match=r"before DataParallel.*amp = unimp.apply\(policy, layer, optimizer\); "
                                         r"model = amp.data_parallel\(\)"):
        unimp.apply(w.SCALED, dp, opt)
    amp = unimp.apply(w.SCALED, model, opt)  # nothing was bound: the right order still works
    amp.remove()


def test_data_parallel_world_size_1_binds_and_remove_unwraps():
    model, opt = w.build()
    amp = unimp.apply(w.SCALED, model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = amp.data_parallel()
    assert isinstance(dp, paddle.DataParallel) and amp.model is dp and dp._layers is model
    assert amp.native["data_parallel"]["nranks"] == 1
    with pytest.raises(RuntimeError, match="already wrapped"):
        amp.data_parallel()
    assert amp.remove() is model and amp.model is model


def test_found_inf_agreement_at_world_size_1_is_the_local_flag():
    from unimp_paddle.distributed import agree_found_inf

    for flag in (True, False):
        t = paddle.to_tensor([flag])
        assert agree_found_inf(t, None) is t  # no collective without a parallel env


def test_world_size_1_data_parallel_skips_by_the_reference_rule():
    model, opt = w.build()
    amp = unimp.apply(w.SCALED, model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = amp.data_parallel()
    rule = LossScale(unimp.load(w.SCALED).loss_scale)
    state = rule.initial_state()
    for step in range(4):
        x, y = w.shard(step, 0, 1)
        amp.backward(paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x)), paddle.to_tensor(y)))
        if step == 2:
            g = model.fc1.bias.grad.numpy()
            g[0] = np.nan
            model.fc1.bias.grad.set_value(g)
        before = w.params(model)
        skipped = amp.optimizer.step()
        amp.optimizer.clear_grad()
        outcome = rule.update(state, step != 2)
        state = outcome.state
        assert skipped == outcome.skipped and amp.scale == state.scale
        assert np.array_equal(before, w.params(model)) == outcome.skipped
    amp.remove()


@pytest.mark.parametrize("mode", ["error", "fallback"])
def test_float16_reduce_on_cpu_follows_on_unsupported(mode):
    model, opt = w.build()
    policy = unimp.load({**w.SCALED, "distributed": {"reduce_dtype": "float16"}, "on_unsupported": mode})
    amp = unimp.apply(policy, model, opt)
    if mode == "error":
        with pytest.raises(UnsupportedError, match=r"(?s)reduce_dtype = 'float16'.*gloo.*fix:"):
            amp.data_parallel()
        assert amp.model is model
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            amp.data_parallel()
        assert amp.native["data_parallel"]["reduce_dtype"] == "float32"
        x = paddle.to_tensor(w.batch(0)[0])
        assert any("fallback: distributed.reduce_dtype" in n for n in amp.report(x).notes)
    amp.remove()
