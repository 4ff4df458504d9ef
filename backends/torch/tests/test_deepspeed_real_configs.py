"""DeepSpeed's own loss scaler, configured from the real DeepSpeed configs of the corpus
(tests/fixtures/real_configs/deepspeed), against the policy ``unimp import`` reads from the same
file, step by step and bit for bit.

DeepSpeed parses the file with its own config model (deepspeed/runtime/precision_config.py
``get_float16_config``) and builds the scaler as the engine does (deepspeed 0.19.8,
deepspeed/runtime/engine.py): without ZeRO ``_configure_fp16_optimizer`` gives FP16_Optimizer a
``LossScaleConfig`` (its ``_update_scale`` is the plain engine's rule); under ZeRO 1-3 the ZeRO
optimizer calls ``CreateLossScaler(dtype, static_loss_scale, dynamic_scaling, dynamic_loss_args)``
(zero/stage_1_and_2.py) -> ``DynamicLossScaler``. The expected values are DeepSpeed's; the policy's
side is the reference rule (:class:`unimp.LossScale`).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket

import deepspeed
import pytest
import torch

from unimp.conformance.loss_scale import reference, sequences
from unimp.migrate import import_from

ROOT = pathlib.Path(__file__).parents[3] / "tests" / "fixtures" / "real_configs" / "deepspeed"
# The corpus files whose fp16 section DeepSpeed reads as written (no HF "auto" to fill in).
FILES = ["dse_bingbertsquad_bsz24.json", "dse_autotuning_fp16_z0.json", "dse_autotuning_fp16_z1.json",
         "dse_autotuning_fp16_z2.json", "dse_autotuning_fp16_z3.json", "dse_autotuning_deberta_fp16_tune.json",
         "dse_imagenet_fp16.json", "dse_imagenet_fp16_z1.json", "dse_bing_bert_lamb_seq128.json",
         "accelerate_zero_stage1_config.json", "accelerate_zero_stage3_offload_config.json"]
# seeded random segments (overflow rates 1% to 99.5%: backoffs down to the floor), and one calm run whose
# clean stretches outlast the files' loss_scale_window (500-1000), so the scale grows too
CALM = ([False] + [True] * 2100) * 2 + [False] * 3 + [True] * 1100 + [False] * 20 + [True] * 600
SEQS = [CALM, *sequences(4, 200, 2500, seed=24)]


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """DeepSpeed's scaler logs overflows with dist.get_rank(): a one-process gloo group."""
    import torch.distributed as dist

    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in keys}
    ours = not dist.is_initialized()
    if ours:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    yield
    if ours:  # later tests (test_distributed.py) need a process without a default group, as they found it
        dist.destroy_process_group()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _deepspeed_scaler(config: dict):
    """(update(overflow), scale()) of the scaler DeepSpeed's engine builds for ``config``."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScaleConfig, LossScaleProfile
    from deepspeed.runtime.precision_config import get_float16_config

    fp16 = get_float16_config(config)
    assert fp16.enabled
    dynamic = fp16.loss_scale == 0  # DeepSpeedConfig.dynamic_loss_scale
    if config.get("zero_optimization", {}).get("stage", 0) > 0:
        ls = CreateLossScaler(dtype=torch.half, static_loss_scale=fp16.loss_scale, dynamic_scaling=dynamic,
                              dynamic_loss_args=fp16.dynamic_loss_scale_args())
        return ls.update_scale, lambda: float(ls.cur_scale)
    opt = object.__new__(FP16_Optimizer)  # the real _update_scale on the real class; no GPU engine needed
    opt.verbose = False
    opt.loss_scale_config = LossScaleConfig(low_precision_dtype=torch.float16, dynamic_loss_scale=dynamic,
                                            static_loss_scale=fp16.loss_scale,
                                            dynamic_loss_args=fp16.dynamic_loss_scale_args(),
                                            profile=LossScaleProfile.FUSED,
                                            initial_dynamic_scale=fp16.initial_dynamic_scale())
    return opt._update_scale, lambda: float(opt.loss_scale_config.cur_scale)


@pytest.mark.parametrize("name", FILES)
def test_deepspeed_scales_as_the_imported_policy(name):
    config = json.loads((ROOT / name).read_text())
    spec = import_from("deepspeed", config, name).policy.loss_scale
    seen = set()
    for j, seq in enumerate(SEQS):
        update, scale = _deepspeed_scaler(config)
        want = reference(spec, seq)
        for i, finite in enumerate(seq):
            try:
                update(not finite)
            except Exception as e:  # DynamicLossScaler raises at the minimum ("already at minimum")
                assert "already at minimum" in str(e), repr(e)
                assert want.error_at == i, f"{name}: sequence {j}: DeepSpeed raised at step {i}, unimp at " \
                                           f"{want.error_at}"
                break
            assert i < len(want.scales), f"{name}: sequence {j}: unimp raised at step {i}, DeepSpeed did not"
            assert scale() == want.scales[i], f"{name}: sequence {j}, step {i}: {scale()} vs {want.scales[i]}"
            assert want.skips[i] == (not finite)
            if i:
                seen.add("grow" if want.scales[i] > want.scales[i - 1] else "back" if want.scales[i] < want.scales[
                    i - 1] else "hold")
    assert seen == {"grow", "back", "hold"}  # the comparison covered growth, backoff and held scales
