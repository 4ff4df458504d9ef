"""The loss-scale rule at its bounds (issue 24: the value range every system accepts; issue 27 item 8:
counters at their bound, ``strict=False``), on the reference :class:`unimp.LossScale` and the Amp base.

The rule is written once (:func:`unimp.loss_scale.rule.step`): counters are int32 on every device, so the
rule saturates ``steps`` / ``skipped`` at 2**31 - 1, grows a tracker at or past the interval on the
next finite step (``tracker + 1 >= interval``, never formed as an int32 sum), and continues DeepSpeed's
window tracker from its residue. Each backend's own test loads a state at the bound and steps it.
"""

import math

import pytest
from test_registry import Model, toy  # noqa: F401 - the toy backend's fixture

import unimp
from unimp import LossScaleState, StateError
from unimp.loss_scale import LossScale, policy_problems
from unimp.policy.spec import INT32_MAX

MAX = INT32_MAX


def _rule(name="mixed_fp16", **knobs):
    return LossScale(unimp.load(name).replace(loss_scale=knobs).loss_scale if knobs else unimp.load(name).loss_scale)


# ---------------------------------------------------------------- counters at the int32 bound


def test_a_tracker_at_the_bound_grows_on_the_next_finite_step():
    """The issue's case: growth_tracker = 2**31 - 1 under mixed_fp16 (interval 2000) grows 65,536 to
    131,072 (tracker + 1 >= interval) and restarts the tracker; a device that formed tracker + 1 in
    int32 wrapped to -2**31 and never grew."""
    rule = _rule()
    out = rule.update(LossScaleState(65536.0, MAX, 1, 0, 0), True).state
    assert (out.scale, out.growth_tracker) == (131072.0, 0)


@pytest.mark.parametrize("finite", [True, False])
def test_steps_and_skipped_saturate(finite):
    rule = _rule()
    out = rule.update(LossScaleState(65536.0, 0, 1, MAX, MAX), finite).state
    assert (out.steps, out.skipped) == (MAX, MAX)
    assert LossScaleState.from_dict(out.to_dict()) == out  # the saturated state is loadable


def test_the_window_tracker_continues_from_its_residue():
    """DeepSpeed grows when (cur_iter - last_overflow_iter) % scale_window == 0 on unbounded Python
    ints (deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale); the int32 window
    tracker continues from its residue at the bound and grows on exactly those steps."""
    rule = _rule("deepspeed_fp16", growth_interval=7, initial=1.0, max=math.inf)
    st = LossScaleState(1.0, MAX - 3, 1, 0, 0)
    for k in range(1, 40):
        before = st.scale
        st = rule.update(st, True).state
        unbounded = MAX - 3 + k - 1  # clean steps before this one, as DeepSpeed counts them
        assert (st.scale > before) == (unbounded > 0 and unbounded % 7 == 0), k
        assert 0 < st.growth_tracker <= MAX


def test_the_largest_counters_load_and_step_in_the_amp(toy):  # noqa: F811
    """steps and skipped at the int32 bound, the tracker at the largest value the rule reaches
    (interval - 1 = 1999): it loads and grows on the next finite step."""
    amp = unimp.apply(unimp.load("mixed_fp16"), Model())
    sd = {**amp.state_dict(), "growth_tracker": 1999, "steps": MAX, "skipped": MAX}
    amp.load_state_dict(sd)
    amp.step(True)
    after = amp.state_dict()
    assert (after["scale"], after["growth_tracker"], after["steps"], after["skipped"]) == (131072.0, 0, MAX, MAX)
    amp.load_state_dict(after)  # the Amp loads its own state dict


# ---------------------------------------------------------------- strict=False relaxes provenance only


def test_strict_false_still_applies_the_policy_rules(toy):  # noqa: F811
    """The issue's case: hysteresis 1, a state saved under hysteresis 3 with three overflows left,
    loaded with strict=False: refused (this rule never holds hysteresis_left 3), not a state that
    keeps the scale at 65,536 through three overflows."""
    amp = unimp.apply(unimp.load("mixed_fp16"), Model())
    other = unimp.load("mixed_fp16").replace(loss_scale={"hysteresis": 3})
    sd = {**amp.state_dict(), "policy_fingerprint": other.fingerprint, "hysteresis_left": 3}
    before = amp.state_dict()
    with pytest.raises(StateError, match=r"hysteresis_left: 3 is above loss_scale.hysteresis \(1\)"):
        amp.load_state_dict(sd, strict=False)
    assert amp.state_dict() == before
    ok = {**sd, "hysteresis_left": 1, "scale": 1024.0}
    with pytest.warns(unimp.UnimpWarning, match="strict=False"):
        amp.load_state_dict(ok, strict=False)  # another policy's fingerprint: taken, with a warning
    assert amp.state_dict()["scale"] == 1024.0


def test_scale_bounds_follow_the_held_dtype():
    """A float32 scale holds at most 3.4e38; DeepSpeed's float64 scale passes it (the reference grows
    there), so a float64 policy's own state above it loads; 0 is a state only a floor of 0 reaches."""
    f32 = unimp.load("mixed_fp16").loss_scale
    f64 = unimp.load("deepspeed_fp16").replace(loss_scale={"max": math.inf}).loss_scale
    assert policy_problems(f32, LossScaleState(1e39)) and not policy_problems(f64, LossScaleState(1e39))
    grown = LossScale(f64).update(LossScaleState(3e38, f64.growth_interval, 1, 0, 0), True).state
    assert grown.scale == 6e38 and not policy_problems(f64, grown)
    keras = unimp.load("keras_mixed_float16").loss_scale  # min 0
    assert not policy_problems(keras, LossScaleState(0.0)) and policy_problems(f32, LossScaleState(0.0))


# ---------------------------------------------------------------- the value range every system accepts


@pytest.mark.parametrize("knobs", [{"initial": 2.0 ** -140, "min": 0.0}, {"backoff_factor": 2.0 ** -140},
                                   {"initial": 2.0 ** -149, "min": 2.0 ** -149}])
def test_subnormal_scales_and_factors_are_accepted(knobs):
    """torch.amp.GradScaler("cpu", init_scale=2**-140) runs (backends/torch/tests/test_loss_scale_bounds.py
    replays it); apex, Paddle and DeepSpeed hold the scale as a Python float."""
    policy = unimp.load("mixed_fp16").replace(loss_scale=knobs)
    assert all(getattr(policy.loss_scale, k) == v for k, v in knobs.items())


def test_below_the_smallest_float32_is_refused():
    with pytest.raises(unimp.PolicyError, match=r"loss_scale.initial: must be >= 1.4013e-45, the smallest float32"):
        unimp.load("mixed_fp16").replace(loss_scale={"initial": 2.0 ** -150, "min": 0.0})


def test_a_subnormal_initial_under_flush_is_refused_with_the_fix():
    """Keras 3 on TensorFlow (subnormal = "flush") reads LossScaleOptimizer(initial_scale=2**-140) back
    as dynamic_scale 0.0 and stays there (measured): refused, naming both fixes."""
    with pytest.raises(unimp.PolicyError, match=r"loss_scale.initial.*subnormal = 'flush'.*subnormal = 'keep'"):
        unimp.load("keras_mixed_float16").replace(loss_scale={"initial": 2.0 ** -140})


# ---------------------------------------------------------------- backoff = "divide"


def test_divide_backs_off_by_the_growth_factor():
    """scale / growth_factor rounded once (eager jmp's ``loss_scale / factor``), not scale x f32(1/f)."""
    divide = _rule("jmp_float16", growth_factor=1.1, backoff_factor=1.0 / 1.1, backoff="divide",
                   initial=43614.2109375)
    multiply = _rule("jmp_float16", growth_factor=1.1, backoff_factor=1.0 / 1.1, initial=43614.2109375)
    assert divide.update(divide.initial_state(), False).scale == 39649.28125
    assert multiply.update(multiply.initial_state(), False).scale == 39649.28515625


def test_divide_needs_the_reciprocal_backoff_factor():
    with pytest.raises(unimp.PolicyError, match=r"backoff_factor must be 1 / growth_factor = 0.333"):
        unimp.load("mixed_fp16").replace(loss_scale={"growth_factor": 3.0, "backoff": "divide"})


def test_preset_fingerprints_are_unchanged_by_the_backoff_knob():
    """Saved state dicts keep loading (strict): the knob's default is left out of the fingerprint
    (mixed_fp16's fingerprint before the knob existed, from main at e0dc498, when its output_dtype was float32)."""
    assert unimp.load("mixed_fp16").replace(output_dtype="float32").fingerprint == "77ad2645bffe9fc3"
    assert unimp.load("mixed_fp16").replace(loss_scale={"backoff_factor": 0.5, "backoff": "divide"}
                                            ).fingerprint != "77ad2645bffe9fc3"


def test_a_flushing_rule_refuses_a_subnormal_scale_it_never_holds():
    keras = unimp.load("keras_mixed_float16").loss_scale  # subnormal = "flush", min 0
    assert policy_problems(keras, LossScaleState(2.0 ** -140)) and not policy_problems(keras, LossScaleState(0.0))
    assert not policy_problems(unimp.load("mixed_fp16").replace(loss_scale={"min": 0.0}).loss_scale,
                               LossScaleState(2.0 ** -140))
