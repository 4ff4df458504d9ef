"""Loss scaling at its bounds on the Paddle backend (issue 27 item 8, issue 24): a state with every
counter at the int32 bound loads and steps through a real dygraph step as the reference
:class:`unimp.LossScale` does, and a subnormal initial scale runs as Paddle's own GradScaler runs it."""

import paddle
import pytest
from test_loss_scale import _gradscaler, _preset

import unimp
from unimp.conformance.state_dicts import check_counters_at_bound
from unimp.loss_scale import LossScale, LossScaleState
from unimp.policy.spec import INT32_MAX


def _apply(policy):
    model = paddle.nn.Linear(8, 8)
    return unimp.apply(unimp.load(policy).replace(on_unsupported="fallback"), model,
                       paddle.optimizer.SGD(0.1, parameters=model.parameters()))


def _step(amp, finite=True):
    x = paddle.ones([4, 8]) * (1.0 if finite else float("inf"))
    amp.backward(amp.model(x).astype("float32").mean())
    amp.optimizer.step()
    amp.optimizer.clear_grad()


@pytest.mark.parametrize("policy", ["mixed_fp16", "paddle_o1", "deepspeed_fp16"])
@pytest.mark.parametrize("finite", [True, False])
def test_counters_at_the_int32_bound_step_as_the_reference(policy, finite):
    amp = _apply(policy)
    st = check_counters_at_bound(amp, _step, finite)
    assert (st.steps, st.skipped) == (INT32_MAX, INT32_MAX)
    spec = amp.plan.loss_scale
    if spec.growth_schedule == "window":  # DeepSpeed's window: continues from its residue, no growth here
        assert st.growth_tracker == (INT32_MAX % spec.growth_interval + 1 if finite else 0) and st.scale <= 1024.0
    else:
        assert st.growth_tracker == 0 and (st.scale > 1024.0) == finite
    amp.remove()


def test_gradscaler_at_the_bound_it_reaches():
    """paddle.amp.GradScaler._update grows at incr_count == incr_every_n_steps (Python ints,
    paddle/amp/grad_scaler.py): from the largest count it produces (interval - 1, interval 2**31 - 1)
    it grows, as the reference does."""
    spec = _preset("paddle_o1", INT32_MAX, 1).loss_scale
    s = _gradscaler(spec, 1)
    s._incr_count = INT32_MAX - 1
    s._cache_found_inf = False
    s._update()
    want = LossScale(spec).update(LossScaleState(spec.initial, INT32_MAX - 1, 1, 0, 0), True).state
    assert float(s._scale.numpy()) == want.scale == 2 * spec.initial and s._incr_count == want.growth_tracker == 0


def test_a_subnormal_initial_scale_runs_as_gradscaler_runs_it():
    """paddle.amp.GradScaler(init_loss_scaling=2**-140) is accepted and its _update keeps float32
    subnormals; the same value in a policy is accepted and the reference gives the same scales."""
    spec = _preset("paddle_o1", 1, 1).replace(loss_scale={"initial": 2.0 ** -140}).loss_scale
    flags = [True, False, False, False, True, True, False]
    s, ref = _gradscaler(spec, 1), LossScale(spec)
    state, got, want = ref.initial_state(), [], []
    for f in flags:
        s._cache_found_inf = not f
        s._update()
        state = ref.update(state, f).state
        got.append(float(s._scale.numpy()))
        want.append(state.scale)
    assert got == want and min(want) < 2.0 ** -140
