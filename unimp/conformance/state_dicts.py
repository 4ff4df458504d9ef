"""Garbage ``state_dict`` s for any backend's ``Amp.load_state_dict`` (a hypothesis property test).

Every backend inherits :meth:`unimp.Amp.load_state_dict`: the whole dict is checked first and one
:class:`unimp.StateError` names each bad key; nothing is applied unless everything is good. A
backend's tests define an ``amp`` fixture (its own Amps, parametrized) and take the checks::

    from unimp.conformance.state_dicts import amp_checks

    (test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
     test_deepcopy_of_the_amp_works_or_is_refused_clearly) = amp_checks()
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from unimp.dtypes import FLT_MAX, INT32_MAX
from unimp.errors import StateError
from unimp.loss_scale import STATE_KEYS, LossScaleState, check_state, max_growth_tracker, policy_problems
from unimp.policy import LossScaleSpec

if TYPE_CHECKING:
    from unimp.backend import Amp

BAD_SCALES = (math.nan, math.inf, -math.inf, -1.0, 0.0, -0.0, 1e39, 3.5e38, 10**400, 1e-50, "65536", None, True,
              [1.0], {"scale": 1.0})
BAD_COUNTERS: tuple[Any, ...] = (-1, -(2**40), 2**31, 10**30, 1.5, 0.5, True, False, "3", None, math.nan, math.inf,
                                 [], 2.0**40)


def bad_scales(valid: dict[str, Any], spec: LossScaleSpec | None = None) -> tuple[Any, ...]:
    """:data:`BAD_SCALES` that are bad for ``spec`` (a float64 scale holds 1e39; a policy with
    ``min = 0`` backs off to 0.0): those :func:`check_state` or :func:`policy_problems` refuse."""
    if spec is None:
        return BAD_SCALES

    def refused(v: Any) -> bool:
        d = {**valid, "scale": v}
        return bool(check_state(d)) or bool(policy_problems(spec, LossScaleState.from_dict(d)))

    return tuple(v for v in BAD_SCALES if refused(v))


def garbage_state_dicts(valid: dict[str, Any], spec: LossScaleSpec | None = None) -> Any:
    """A hypothesis strategy: ``valid`` with 1-3 keys made bad (and maybe others changed validly);
    ``spec``: the Amp's resolved loss scale (what counts as a bad scale depends on it)."""
    from hypothesis import strategies as st

    scales = bad_scales(valid, spec)

    @st.composite
    def build(draw: Any) -> Any:  # a state dict, or ("not a mapping") anything else
        d = dict(valid)
        changes = draw(st.dictionaries(st.sampled_from(STATE_KEYS[1:4]), st.integers(0, 3), max_size=2))
        for key, value in changes.items():
            d[key] = value + (1 if key == "hysteresis_left" and value == 0 else 0)  # valid changes
        if draw(st.booleans()):
            d["scale"] = draw(st.sampled_from([1.0, 2.0**10, FLT_MAX]))
        how = draw(st.sampled_from(["value", "value", "missing", "skipped>steps", "not a mapping"]))
        if how == "missing":
            for key in draw(st.lists(st.sampled_from(STATE_KEYS), min_size=1, max_size=3, unique=True)):
                d.pop(key)
        elif how == "skipped>steps":
            d["steps"] = draw(st.integers(0, 100))
            d["skipped"] = d["steps"] + draw(st.integers(1, 100))
        elif how == "not a mapping":
            return draw(st.sampled_from([None, [], "state", 1.0, [("scale", 1.0)]]))
        else:
            for key in draw(st.lists(st.sampled_from(STATE_KEYS), min_size=1, max_size=3, unique=True)):
                d[key] = draw(st.sampled_from(scales if key == "scale" else BAD_COUNTERS))
        return d

    return build()


def extreme_state(amp: Any) -> dict[str, Any]:
    """The largest state every backend must hold: scale = the largest float32, counters at the int32
    bound (the growth tracker at the largest value its schedule reaches: a tracker past the interval
    is a state the policy never produces, which a backend may refuse where its native rule would not
    grow from it)."""
    sd = amp.state_dict()
    spec = amp._loss_scale_run()  # what the backend runs (the Plan with its fallbacks)
    tracker = max_growth_tracker(spec)
    return {**sd, "scale": FLT_MAX if spec.mode == "dynamic" else sd["scale"],
            "growth_tracker": tracker, "skipped": INT32_MAX, "steps": INT32_MAX,
            "hysteresis_left": spec.hysteresis}


def check_refused(amp: Any, bad: Any) -> None:
    """``amp.load_state_dict(bad)`` raises StateError and leaves the state exactly as it was."""
    before = amp.state_dict()
    try:
        amp.load_state_dict(bad)
    except StateError as e:
        assert str(e), "a StateError without a message"
    except Exception as e:
        raise AssertionError(f"{amp.backend}: load_state_dict({bad!r:.200}) raised {type(e).__name__}: {e}") from e
    else:
        raise AssertionError(f"{amp.backend}: load_state_dict accepted garbage {bad!r:.200}")
    after = amp.state_dict()
    assert after == before, f"{amp.backend}: a refused load changed the state: {before} -> {after}"


def check_round_trip(amp: Any) -> None:
    """The extreme valid state loads and reads back exactly (every bound is holdable)."""
    state = extreme_state(amp)
    amp.load_state_dict(state)
    assert amp.state_dict() == state, f"{amp.backend}: {state} read back as {amp.state_dict()}"


def check_copy(amp: Any) -> None:
    """``copy.deepcopy(amp)`` gives an Amp with the same state, or a clear UnsupportedError naming the fix."""
    import copy

    from unimp.errors import UnsupportedError

    try:
        twin = copy.deepcopy(amp)
    except UnsupportedError as e:
        assert "new.load_state_dict(amp.state_dict())" in str(e), str(e)
        return
    assert twin is not amp and twin.state_dict() == amp.state_dict()
    twin.remove()


def check_removed(amp: Any) -> None:
    """After ``amp.remove()`` the base verbs refuse with a StateError that says to apply again."""
    sd = amp.state_dict()
    amp.remove()
    for verb in (amp.state_dict, lambda: amp.load_state_dict(sd), lambda: amp.scale, amp.loss_scale_state,
                 lambda: amp.set_loss_scale_state(LossScaleState(1.0)), amp.report):
        try:
            verb()
        except StateError as e:
            assert "was removed" in str(e), str(e)
        else:
            raise AssertionError(f"{amp.backend}: a removed Amp still answered")


def amp_checks(max_examples: int = 30) -> tuple[Any, Any, Any]:
    """The checks every backend runs over its ``amp`` fixture, as pytest test functions: garbage state
    dicts refused with nothing applied (hypothesis), the extreme valid state round trip, deepcopy."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_garbage_state_dicts_are_refused_and_change_nothing(amp: Any, data: Any) -> None:
        check_refused(amp, data.draw(garbage_state_dicts(amp.state_dict(), amp._loss_scale_run())))

    def test_the_largest_valid_state_round_trips(amp: Any) -> None:
        check_round_trip(amp)  # counters are int32 on device: INT32_MAX must not wrap

    def test_deepcopy_of_the_amp_works_or_is_refused_clearly(amp: Any) -> None:
        check_copy(amp)

    return (test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
            test_deepcopy_of_the_amp_works_or_is_refused_clearly)


def check_counters_at_bound(amp: Amp, step: Any, finite: bool = True) -> LossScaleState:
    """Load a state with every counter at its bound (steps and skipped at the int32 bound, the growth tracker
    at the largest value the rule reaches: :func:`unimp.loss_scale.max_growth_tracker`), run one real
    training step (``step(amp, finite)``) and compare the state with the reference
    :class:`unimp.LossScale` from the same state; the Amp then loads its own state dict. A backend whose
    native rule cannot run from that tracker refuses the load with a :class:`StateError` and changes
    nothing (then the check returns the unchanged state). Returns the state after the step.

    The rule (:func:`unimp.loss_scale.rule.step`): counters saturate, a tracker at the interval's end grows
    on the next finite step; no device counter wraps to -2**31.
    """
    from unimp.loss_scale import LossScale

    spec = amp._loss_scale_run()  # what the backend runs (the Plan with its fallbacks)
    sd = {**amp.state_dict(), "growth_tracker": max_growth_tracker(spec), "steps": INT32_MAX, "skipped": INT32_MAX,
          "hysteresis_left": spec.hysteresis}
    if spec.mode == "dynamic":
        sd["scale"] = max(1024.0, spec.min)  # a real finite step stays finite in float16 at this scale
    before = amp.state_dict()
    try:
        amp.load_state_dict(sd)
    except StateError:
        assert amp.state_dict() == before, f"{amp.backend}: a refused load changed the state"
        return amp.loss_scale_state()
    want = LossScale(spec).update(LossScaleState.from_dict(sd), finite).state
    step(amp, finite)
    got = amp.loss_scale_state()
    assert got == want, f"{amp.backend}: from the int32 bound, one step gave {got}; the reference {want}"
    amp.load_state_dict(amp.state_dict())  # an Amp loads its own state dict
    return got
