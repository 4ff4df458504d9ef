"""The Amp base: whole-dict validation of state dicts (one StateError), atomic loads, refusal after
remove(), and deepcopy (issue 14, items 6, 13 and 18), through the pure-Python test plug-in."""

import copy
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_registry import Model, toy  # noqa: F401 - the toy backend's fixture

import unimp
from unimp import LossScaleState, StateError
from unimp.conformance.state_dicts import check_refused, check_round_trip, garbage_state_dicts
from unimp.policy.spec import FLT_MAX, INT32_MAX

POLICY = unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 1, "hysteresis": 3})


@pytest.fixture
def amp():
    a = unimp.apply(POLICY, Model())
    for finite in (True, True, False):
        a.step(finite)
    yield a
    a.remove()


@pytest.mark.parametrize("key,value,words", [
    ("scale", math.nan, "scale: nan is not a finite number >= 0"),
    ("scale", math.inf, "scale: inf"), ("scale", -math.inf, "scale: -inf"), ("scale", -2.0, "scale: -2.0"),
    ("scale", 0.0, "scale: 0.0"), ("scale", 1e39, "scale: 1e+39"), ("scale", "65536", "scale: expected a number"),
    ("scale", None, "scale: expected a number"), ("scale", 10**400, "is not a finite number"),
    ("scale", -0.0, "scale: -0.0"),
    ("steps", -1, "steps: an integer -1 is out of range"), ("growth_tracker", 2**31, "int32"),
    ("steps", 2.5, "steps: expected a whole number, got a number 2.5"),
    ("skipped", True, "skipped: expected a whole number, got a boolean"),
    ("hysteresis_left", "1", "hysteresis_left: expected a whole number, got a string"),
    ("growth_tracker", [1], "growth_tracker: expected a whole number, got a list"),
    ("hysteresis_left", 0, "hysteresis_left: 0 is out of range"),
    ("hysteresis_left", 4, "above loss_scale.hysteresis (3)"),
    ("skipped", 10**6, "skipped (1000000) is more than steps (3)"),
])
def test_each_kind_of_garbage_is_one_state_error_naming_key_and_value(amp, key, value, words):
    sd = {**amp.state_dict(), key: value}
    with pytest.raises(StateError) as e:
        amp.load_state_dict(sd)
    assert words in str(e.value)
    if "loss_scale" not in str(e.value):  # a fact of the policy (its float32 scale, its floor): only the Amp knows it
        with pytest.raises(StateError, match=key):
            LossScaleState.from_dict(sd)


def test_every_problem_is_named_at_once(amp):
    sd = {**amp.state_dict(), "scale": math.nan, "steps": -1, "growth_tracker": 1.5}
    with pytest.raises(StateError) as e:
        amp.load_state_dict(sd)
    assert all(k in str(e.value) for k in ("scale:", "steps:", "growth_tracker:"))


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_garbage_state_dicts_are_refused_and_change_nothing(amp, data):
    check_refused(amp, data.draw(garbage_state_dicts(amp.state_dict())))


def test_the_largest_valid_state_round_trips(amp):
    check_round_trip(amp)
    assert amp.scale == FLT_MAX and amp.state_dict()["steps"] == INT32_MAX


def test_a_backend_that_fails_half_way_is_rolled_back(amp):
    class HalfAmp(type(amp)):
        def set_loss_scale_state(self, state):
            self._state = LossScaleState(state.scale, self._state.growth_tracker)  # first half applied...
            if state.scale == 2.0:
                raise OverflowError("int too large")  # ...then the framework refuses
            self._state = state

    amp.__class__ = HalfAmp
    before = amp.state_dict()
    with pytest.raises(StateError, match="nothing was changed"):
        amp.load_state_dict({**before, "scale": 2.0})
    assert amp.state_dict() == before


def test_counters_saved_as_integral_floats_or_numpy_like_ints_load(amp):
    sd = amp.state_dict()
    amp.load_state_dict({**sd, "steps": float(sd["steps"]), "skipped": 1.0})
    assert amp.state_dict()["steps"] == sd["steps"] and isinstance(amp.state_dict()["steps"], int)


# ---------------------------------------------------------------- item 6: after remove()


def test_every_base_verb_refuses_after_remove(amp):
    sd = amp.state_dict()
    amp.remove()
    for verb, call in [("amp.state_dict()", amp.state_dict), ("amp.load_state_dict()", lambda: amp.load_state_dict(sd)),
                       ("amp.scale", lambda: amp.scale), ("amp.skipped_steps", lambda: amp.skipped_steps),
                       ("amp.report()", amp.report), ("copy.deepcopy(amp)", lambda: copy.deepcopy(amp)),
                       ("amp.loss_scale_state()", amp.loss_scale_state),  # a backend's own methods: guarded
                       ("amp.set_loss_scale_state()", lambda: amp.set_loss_scale_state(LossScaleState(1.0)))]:
        with pytest.raises(StateError, match=r"was removed.*unimp.apply") as e:
            call()
        assert str(e.value).startswith(verb)
    assert amp.remove() is amp.model  # remove() itself stays idempotent


def test_backends_get_the_check_as_one_helper(amp):
    amp._check_live("amp.optimizer.step()")
    amp.remove()
    with pytest.raises(StateError, match=r"^amp.optimizer.step\(\): this Amp was removed"):
        amp._check_live("amp.optimizer.step()")


# ---------------------------------------------------------------- item 18: deepcopy


def test_deepcopy_gives_an_independent_amp(amp):
    twin = copy.deepcopy(amp)
    assert twin.state_dict() == amp.state_dict()
    assert twin.model is not amp.model and twin.model.weights == amp.model.weights
    twin.step(True)
    assert twin.state_dict() != amp.state_dict()
    with pytest.raises(RuntimeError, match="already has a unimp policy applied"):
        unimp.apply(POLICY, twin.model)  # the copy's model counts as applied...
    twin.remove()
    unimp.apply(POLICY, twin.model).remove()  # ...until the copy is removed
    assert amp.state_dict()["steps"] == 3


def test_deepcopy_that_cannot_copy_is_refused_with_the_fix(amp):
    amp.optimizer = _Uncopyable()
    fix = r"copy.deepcopy\(amp\).*new.load_state_dict\(amp.state_dict\(\)\)"
    with pytest.raises(unimp.UnsupportedError, match=fix):
        copy.deepcopy(amp)


class _Uncopyable:
    def __deepcopy__(self, memo):
        raise AttributeError("no attribute 'optimizer'")


def test_a_state_saved_before_the_outputs_became_unchanged_loads_strictly(amp):
    """mixed_fp16's outputs became "unchanged" (its fingerprint changed): a state dict saved under the old
    fingerprint (output_dtype float32, main at e0dc498) still loads strictly; another policy's does not."""
    state = amp.state_dict()
    old = {**state, "policy_fingerprint": POLICY.replace(output_dtype="float32").fingerprint}
    assert POLICY.output_dtype == "unchanged" and old["policy_fingerprint"] != state["policy_fingerprint"]
    assert unimp.load("mixed_fp16").replace(output_dtype="float32").fingerprint == "77ad2645bffe9fc3"
    amp.load_state_dict(old)
    assert amp.state_dict() == state
    other = {**state, "policy_fingerprint": POLICY.replace(loss_scale={"growth_interval": 2}).fingerprint}
    with pytest.raises(StateError, match="fingerprint"):
        amp.load_state_dict(other)
