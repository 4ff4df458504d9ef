"""The reference against each system's own loss scaler, bit for bit, on the system replay sequences
(:func:`unimp.conformance.loss_scale.system_cases`: 200 sequences of 50-4,200 steps, scales driven
to the floor, the cap, past float32's max and into the subnormal range).

DeepSpeed (ZeRO's DynamicLossScaler, the plain engine's FP16_Optimizer._update_scale), tf.keras
(_DynamicLossScaleState, not in the tensorflow env) and
Megatron-Core (DynamicGradScaler) do not install in the tox matrix: their real objects were driven
by ``tests/fixtures/make_loss_scale_systems.py`` and one digest per sequence recorded. apex cannot
be installed at all: :class:`ApexLossScaler` is its last ``LossScaler`` transcribed line by line.
Without ``UNIMP_FULL_REPLAY=1`` the first 16 sequences run (the full 200 take ~1 min).
"""

import json
import os
import pathlib

import pytest

import unimp
from unimp.conformance.loss_scale import FULL_REPLAY, Replay, check_system_replay, digest, reference, system_cases

FIXTURE = json.loads(pathlib.Path(__file__).with_name("fixtures").joinpath("loss_scale_systems.json").read_text())
N = FIXTURE["n"] if os.environ.get(FULL_REPLAY) else 16


@pytest.mark.parametrize("preset", ["deepspeed_zero_fp16", "deepspeed_fp16", "megatron_fp16", "tf_keras_mixed_float16"])
def test_reference_replays_the_recorded_system(preset):
    cases = system_cases(unimp.load(preset).loss_scale, FIXTURE["n"], FIXTURE["max_len"], FIXTURE["seed"])
    matched = 0
    for j, ((spec, seq), (want, crash)) in enumerate(zip(cases[:N], FIXTURE[preset][:N], strict=True)):
        rep = reference(spec, seq)
        if crash is not None:  # DeepSpeed raised OverflowError there (an overflow at scale inf)
            assert rep.scales[crash - 1] == float("inf")
            rep = Replay(rep.scales[:crash], rep.skips[:crash], None)
        assert digest(rep) == want, f"{preset}: sequence {j} (growth_interval {spec.growth_interval}) differs"
        matched += 1
    assert matched == N


def test_the_recorded_sequences_reach_the_edges():
    """The replay is not vacuous: the plain engine's float64 scale passes float32's max, the ZeRO
    scaler hits its floor error, and apex's goes below float32's smallest subnormal."""
    spec = unimp.load("deepspeed_fp16").loss_scale
    assert any(max(reference(s, q).scales) > 3.5e38 for s, q in system_cases(spec, 8, 4200, FIXTURE["seed"]))
    zero = unimp.load("deepspeed_zero_fp16").loss_scale
    assert any(reference(s, q).error_at is not None for s, q in system_cases(zero, 8, 4200, FIXTURE["seed"]))
    apex = unimp.load("apex_o1").loss_scale
    assert any(0 < min(reference(s, q).scales) < 2.0 ** -149 for s, q in system_cases(apex, 8, 4200, FIXTURE["seed"]))


class ApexLossScaler:
    """apex/amp/scaler.py ``LossScaler`` (dynamic), its update_scale transcribed (Python floats)."""

    def __init__(self, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=2000, min_loss_scale=None,
                 max_loss_scale=2.0 ** 24):
        self._loss_scale = min(max_loss_scale, init_scale)
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False
        self.dynamic = True

    def update_scale(self):
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / 2.)
            else:
                self._loss_scale = self._loss_scale / 2.
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * 2.)
            self._unskipped = 0
        return should_skip


def _apex(spec, seq):
    ls = ApexLossScaler(scale_window=spec.growth_interval)
    scales, skips = [], []
    for f in seq:
        ls._has_overflow = not f
        skips.append(ls.update_scale())
        scales.append(ls._loss_scale)
    return Replay(scales, skips)


def test_reference_replays_apex():
    n, longest = (200, 4200) if os.environ.get(FULL_REPLAY) else (16, 4200)
    assert check_system_replay(_apex, unimp.load("apex_o1").loss_scale, n=n, max_len=longest) == n
