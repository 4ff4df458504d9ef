"""The loss-scale reference against hand-derived trajectories of each system's documented rule.

Each expected list below was worked out by hand from the source named in the preset's comment
(not produced by the reference): T = finite step, X = non-finite step.
"""

import math

import pytest

import unimp
from unimp.loss_scale import LossScale, LossScaleAtMinimumError, LossScaleState, f32, trajectory

FLT_MAX = 3.4028234663852886e38


def run(preset, steps, **knobs):
    spec = unimp.load(preset).replace(loss_scale=knobs).loss_scale
    finites = [c == "T" for c in steps.replace(" ", "")]
    return trajectory(spec, finites)


def test_torch_gradscaler_rule():
    scales, skips = run("torch_autocast_cuda", "TTT X TTX TTT", initial=8.0, growth_interval=3)
    assert scales == [8, 8, 16, 8, 8, 8, 4, 4, 4, 8]
    assert skips == [False] * 3 + [True] + [False] * 2 + [True] + [False] * 3


def test_torch_has_no_floor_and_keeps_finite_growth_only():
    assert run("torch_autocast_cuda", "XXX", initial=1.0, growth_interval=3)[0] == [0.5, 0.25, 0.125]
    big = 2.0**127
    assert run("torch_autocast_cuda", "TT", initial=big, growth_interval=1)[0] == [big, big]


def test_keras3_rule_has_no_floor_and_no_finiteness_check():
    assert run("keras_mixed_float16", "TTT X", initial=8.0, growth_interval=3)[0] == [8, 8, 16, 8]
    assert run("keras_mixed_float16", "X", initial=1.0)[0] == [0.5]
    assert run("keras_mixed_float16", "T", initial=2.0**127, growth_interval=1)[0] == [math.inf]
    assert unimp.load("keras_mixed_float16").loss_scale.initial == 2.0**15


def test_tf_keras_floors_at_one():
    assert run("tf_keras_mixed_float16", "XX", initial=2.0)[0] == [1.0, 1.0]
    big = 2.0**127
    assert run("tf_keras_mixed_float16", "T", initial=big, growth_interval=1)[0] == [big]


def test_jmp_grows_on_the_nth_step_floors_at_min():
    assert run("jmp_float16", "TTT X XX", initial=4.0, growth_interval=3)[0] == [4, 4, 8, 4, 2, 1]


def test_flax_grows_on_the_step_after_the_nth_and_clamps_at_f32_max():
    scales, _ = run("flax_dynamic_scale", "TTT TTT X TT T", initial=8.0, growth_interval=2)
    assert scales == [8, 8, 16, 16, 16, 32, 16, 16, 16, 32]
    assert run("flax_dynamic_scale", "TT", initial=2.0**127, growth_interval=1)[0] == [2.0**127, FLT_MAX]
    tiny = unimp.load("flax_dynamic_scale").loss_scale.min
    assert run("flax_dynamic_scale", "X", initial=tiny)[0] == [tiny]


def test_paddle_decr_every_n_counts_consecutive_bad_steps_and_resets_after_backoff():
    scales, skips = run("paddle_o1", "X X X T X X TT", initial=8.0, growth_interval=2, hysteresis=2)
    assert scales == [8, 4, 4, 4, 4, 2, 2, 4]
    assert skips == [True, True, True, False, True, True, False, False]
    assert run("paddle_o1", "X", initial=1.0)[0] == [0.5]  # dygraph GradScaler: no floor
    assert run("paddle_static_o1", "X", initial=1.0)[0] == [1.0]  # the static graph's kernel: floor 1


def test_deepspeed_zero_window_hysteresis_and_error_at_min():
    scales, skips = run("deepspeed_zero_fp16", "TTT TT X T XX TTT X", initial=8.0, growth_interval=2)
    assert scales == [8, 8, 16, 16, 32, 32, 32, 16, 8, 8, 8, 16, 16]
    assert skips == [False] * 5 + [True, False, True, True, False, False, False, True]
    with pytest.raises(LossScaleAtMinimumError, match="at_min"):
        run("deepspeed_zero_fp16", "X", initial=1.0, hysteresis=1)


def test_deepspeed_plain_engine_has_no_hysteresis_and_clamps_at_min():
    """FP16_Optimizer._update_scale: every overflow backs off, max(scale/2, min_loss_scale)."""
    scales, skips = run("deepspeed_fp16", "TTT TT X T XX TTT X", initial=8.0, growth_interval=2)
    assert scales == [8, 8, 16, 16, 32, 16, 16, 8, 4, 4, 4, 8, 4]
    assert skips == [False] * 5 + [True, False, True, True, False, False, False, True]
    assert run("deepspeed_fp16", "XX", initial=1.0)[0] == [1.0, 1.0]  # clamped, never raises


def test_growth_at_the_float32_max_clamps_to_it():
    """on_max = "clamp" with max = FLT_MAX: the grown scale is inf, clamped to FLT_MAX (as Flax
    does); the finiteness check must not keep the old scale."""
    spec = {"initial": 2.0 ** 127, "growth_interval": 1}
    assert run("flax_dynamic_scale", "TTT", **spec)[0] == [2.0 ** 127, FLT_MAX, FLT_MAX]  # grows on the 2nd
    assert run("flax_dynamic_scale", "TT", **spec, growth_schedule="interval")[0] == [FLT_MAX, FLT_MAX]
    assert run("flax_dynamic_scale", "TTT", **spec, on_max="keep")[0] == [2.0 ** 127] * 3


def test_float64_scales_pass_the_float32_max_and_go_below_its_subnormals():
    """DeepSpeed and apex hold a Python float: 2**127 * 2 is 2**128 (float32: inf), and
    2**-149 / 2 is 2**-150 (float32: 0)."""
    up = run("deepspeed_zero_fp16", "TTT", initial=2.0 ** 127, growth_interval=1)[0]
    assert up == [2.0 ** 127, 2.0 ** 128, 2.0 ** 129]
    assert run("deepspeed_zero_fp16", "TTT", initial=2.0 ** 127, growth_interval=1, scale_dtype="float32")[0] == [
        2.0 ** 127, math.inf, math.inf]
    down = run("apex_o1", "XX", initial=2.0 ** -126, growth_interval=1)[0]
    assert down == [2.0 ** -127, 2.0 ** -128]
    tiny = run("apex_o1", "XX", initial=2.0 ** -126)[0]
    assert run("apex_o1", "X" * 25, initial=2.0 ** -126)[0][-1] == 2.0 ** -151 and tiny[0] == 2.0 ** -127
    assert run("apex_o1", "X" * 25, initial=2.0 ** -126, scale_dtype="float32")[0][-1] == 0.0


def test_subnormal_scales_are_kept_or_flushed():
    """torch/Paddle keep 2**-127 (a float32 subnormal); Keras 3 on TensorFlow flushes it to 0."""
    assert run("torch_autocast_cuda", "XX", initial=2.0 ** -125)[0] == [2.0 ** -126, 2.0 ** -127]
    assert run("keras_mixed_float16", "XX", initial=2.0 ** -125)[0] == [2.0 ** -126, 0.0]
    assert run("keras_mixed_float16", "XXT", initial=2.0 ** -125, growth_interval=1)[0] == [2.0 ** -126, 0.0, 0.0]


def test_factor_arithmetic_float32_rounds_the_factor_first():
    """1.1 is not a float32: torch forms f32(scale * 1.1); jmp/Flax/Paddle multiply by f32(1.1) in
    float32. 3 * 1.1 -> 3.3000002 (float64 product) vs 3.3000002 + 1 ulp (float32 factor)."""
    f64 = run("torch_autocast_cuda", "T", initial=3.0, growth_interval=1, growth_factor=1.1)[0][0]
    f32_ = run("torch_autocast_cuda", "T", initial=3.0, growth_interval=1, growth_factor=1.1,
               factor_arithmetic="float32")[0][0]
    assert f64 == f32(3.0 * 1.1) and f32_ == f32(3.0 * f32(1.1)) and f64 != f32_


def test_megatron_hysteresis_refills_only_on_growth():
    scales, _ = run("megatron_fp16", "TT X X T X TT X", initial=8.0, growth_interval=2)
    assert scales == [8, 16, 16, 8, 8, 4, 4, 8, 8]
    assert unimp.load("megatron_fp16").loss_scale.initial == 2.0**32


def test_apex_clamps_at_2_pow_24():
    cap = 2.0**24
    assert run("apex_o1", "T", initial=cap / 2 * 1.5, growth_interval=1)[0] == [cap]


def test_static_and_none_modes_keep_the_scale():
    assert run("mixed_fp16", "TXT", mode="static", initial=128.0) == ([128.0] * 3, [False, True, False])
    assert run("mixed_bf16", "TXT") == ([1.0] * 3, [False, False, False])
    assert run("mixed_bf16", "TXT", skip_nonfinite=True)[1] == [False, True, False]


def test_scale_is_held_in_float32():
    scales, _ = run("torch_autocast_cuda", "T", initial=1.0, growth_interval=1, growth_factor=1.1)
    assert scales == [f32(1.1)] and scales[0] != 1.1


def test_state_round_trip_and_counters():
    rule = LossScale(unimp.load("mixed_fp16").loss_scale)
    outs = list(rule.replay([True, False, True]))
    st = outs[-1].state
    assert (st.steps, st.skipped) == (3, 1)
    assert LossScaleState.from_dict(st.to_dict()) == st
    with pytest.raises(unimp.StateError, match="missing keys"):
        LossScaleState.from_dict({"scale": 1.0})


def test_replay_continues_from_a_saved_state():
    spec = unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 2}).loss_scale
    seq = [True, False, True, True, True, False, True]
    full = trajectory(spec, seq)[0]
    rule = LossScale(spec)
    mid = list(rule.replay(seq[:3]))[-1].state
    assert trajectory(spec, seq[3:], mid)[0] == full[3:]
