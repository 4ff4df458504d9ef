"""FP8 training on XLA (emulated on CPU): the Plan's layers run scaled e4m3/e5m2 dots, nnx and linen.

Tolerance: after 20 Adam steps the FP8 run's loss is within 10% of the bf16 run's (e4m3 keeps 3
mantissa bits; the tiny MLP's losses agree to ~4% in practice).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from fp8_models import LinenMLP, NnxMLP

import unimp
from unimp.conformance import run_case
from unimp.conformance.fp8 import fp8_cases
from unimp_jax import fp8

pytestmark = pytest.mark.filterwarnings("ignore::unimp.UnimpWarning")  # bf16 on XLA:CPU, the misaligned head

RECIPES = ("fp8_delayed", "fp8_tensorwise")
# FP8 (not derived, kept as is; issue 27): e4m3 keeps 3 mantissa bits (u = 2**-4), so u*sqrt(n) would
# exceed 6% a layer; 10% is a stated bound of the final loss against bf16's after 20 steps
STEPS, TOL = 20, 0.10


def _data():
    x = jax.random.normal(jax.random.key(1), (32, 32))
    y = jax.random.normal(jax.random.key(2), (32, 10))
    return x, y


def _loss(y):
    return lambda out: ((out.astype(jnp.float32) - y) ** 2).mean()


def _nnx_step(amp, y):
    def loss_fn(m, x):
        return _loss(y)(m(x))

    @nnx.jit
    def step(model, opt, x):
        loss, grads, _ = amp.value_and_grad(loss_fn)(opt, model, x)
        opt.update(model, grads)
        return loss

    return step


def _nnx_run(policy, steps=STEPS):
    x, y = _data()
    amp = unimp.apply(policy, NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    step = _nnx_step(amp, y)
    return amp, [float(step(amp.model, amp.optimizer, x)) for _ in range(steps)]


def _linen_amp(policy):
    x, _ = _data()
    module = LinenMLP()
    return unimp.apply(policy, module, optax.adam(1e-2), params=module.init(jax.random.key(0), x)["params"],
                       inputs=x)


def _linen_step(amp, y):
    @jax.jit
    def step(params, opt_state, x):
        loss, grads, _ = amp.value_and_grad(lambda p: _loss(y)(amp.apply(p, x)))(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state, loss

    return step


def _linen_run(policy, steps=STEPS):
    x, y = _data()
    amp = _linen_amp(policy)
    step = _linen_step(amp, y)
    losses = []
    for _ in range(steps):
        amp.params, amp.opt_state, loss = step(amp.params, amp.opt_state, x)
        losses.append(float(loss))
    return amp, losses


RUNS = {"nnx": _nnx_run, "linen": _linen_run}


@pytest.fixture(scope="module")
def bf16_losses():
    out = {}
    for api, run in RUNS.items():
        amp, losses = run("mixed_bf16")
        amp.remove()
        out[api] = losses
    return out


@pytest.mark.parametrize("api", sorted(RUNS))
@pytest.mark.parametrize("policy", RECIPES)
def test_fp8_trains_close_to_bf16(api, policy, bf16_losses):
    amp, losses = RUNS[api](policy)
    recipe = unimp.load(policy).fp8.recipe
    rows = {r.path: r for r in amp.report().rows}
    assert {p: r.fp8 for p, r in rows.items()} == {"fc1": recipe, "fc2": recipe, "head": None}
    assert losses[-1] < 0.7 * losses[0]
    ref = bf16_losses[api][-1]
    assert abs(losses[-1] - ref) <= TOL * ref, (losses[-1], ref)
    assert losses != bf16_losses[api]  # FP8 numerics, not the bf16 run again
    amp.remove()


@pytest.mark.parametrize("policy", RECIPES)
def test_fp8_dots_are_in_the_compiled_step_and_jit_pure(policy):
    """The step's HLO multiplies float8 operands (e4m3 forward, e5m2 gradient); no host callback."""
    x, y = _data()
    amp = unimp.apply(policy, NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    graphdef, state = nnx.split((amp.model, amp.optimizer))

    def pure(state, x):
        model, opt = nnx.merge(graphdef, state)
        loss, grads, _ = amp.value_and_grad(lambda m, x: _loss(y)(m(x)))(opt, model, x)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))  # the updated state: the backward is live

    hlo = jax.jit(pure).lower(state, x).as_text()
    jaxpr = str(jax.make_jaxpr(pure)(state, x))
    assert "f8E4M3FN" in hlo and "f8E5M2" in hlo
    assert "callback" not in jaxpr
    amp.remove()
    graphdef, state = nnx.split((amp.model, amp.optimizer))  # the same model after remove(): no FP8 left
    assert "f8E4M3FN" not in jax.jit(lambda s, x: pure(s, x)).lower(state, x).as_text()  # a new trace


def test_tensorwise_step_has_no_dot_but_the_fp8_gemms_and_the_model_s_own():
    """Per-tensor scales multiply as scalars (``sx * sw``, as Flax's recipe and torchao write it): the
    lowered step holds no ``dot_general`` of size-1 float32 scale arrays, a degenerate dot a GPU
    compiler would have to lower (12 of them in a 2-block GPT step before)."""
    x, y = _data()
    amp = unimp.apply("fp8_tensorwise", NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    graphdef, state = nnx.split((amp.model, amp.optimizer))

    def pure(state, x):
        model, opt = nnx.merge(graphdef, state)
        loss, grads, _ = amp.value_and_grad(lambda m, x: _loss(y)(m(x)))(opt, model, x)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))

    dots = [line for line in jax.jit(pure).lower(state, x).as_text().splitlines() if "dot_general" in line]
    scale_dots = [d for d in dots if re.search(r"\(tensor<(1x)*1?xf32>, tensor<(1x)*1?xf32>\)", d)]
    assert dots and not scale_dots, scale_dots
    assert any("f8E4M3FN" in d for d in dots)
    amp.remove()


def test_misaligned_layer_stays_in_compute_dtype_and_is_reported():
    amp = unimp.apply("fp8_tensorwise", NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    report = amp.report(jnp.ones((2, 32)))
    head = next(r for r in report.rows if r.path == "head")
    assert (head.fp8, head.compute_dtype) == (None, amp.plan.compute_dtype)
    assert any("head" in n and "dims_multiple" in n for n in report.notes)
    amp.remove()


@pytest.mark.parametrize("api", sorted(RUNS))
def test_delayed_state_round_trips_state_dict_exactly(api):
    amp, _ = RUNS[api]("fp8_delayed", steps=3)
    sd = amp.state_dict()
    trained = jax.tree_util.tree_leaves(amp.fp8_state())
    assert set(sd["fp8"]) >= {"fc1.input_scale", "fc2.output_grad_amax_history"} and "head.input_scale" not in sd["fp8"]
    assert sd["fp8"]["fc1.input_scale"] != [1.0]  # trained state, not the initial one
    amp.remove()
    fresh = RUNS[api]("fp8_delayed", steps=0)[0]
    fresh.load_state_dict(sd)
    loaded = jax.tree_util.tree_leaves(fresh.fp8_state())
    assert all(np.array_equal(a, b) for a, b in zip(trained, loaded, strict=True))
    assert fresh.state_dict() == sd
    bad = {**sd, "fp8": {**sd["fp8"], "fc1.input_scale": [1.0, 2.0]}}
    with pytest.raises(unimp.StateError, match="fp8.fc1.input_scale"):
        fresh.load_state_dict(bad)
    fresh.remove()


def test_skipped_step_keeps_the_delayed_state():
    policy = unimp.load("fp8_delayed").replace(loss_scale={"mode": "dynamic", "initial": 2.0 ** 10})
    x, y = _data()
    amp = unimp.apply(policy, NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    step = _nnx_step(amp, y)
    step(amp.model, amp.optimizer, x)
    before = amp.state_dict()["fp8"]
    step(amp.model, amp.optimizer, x.at[0, 0].set(jnp.nan))  # (an inf input would clip to the FP8 max)
    assert amp.skipped_steps == 1
    assert amp.state_dict()["fp8"] == before
    amp.remove()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_current_scaling_passes_an_overflow_on_to_the_loss_scale_check(recipe):
    """An inf reaching an FP8 layer (an fp16 overflow) makes its output non-finite, as in torchao
    (amax inf: scale inf, inf / inf = nan), so the step is skipped and changes nothing; the scaled
    quantization must not clip it to the FP8 max and train on the clipped value."""
    policy = unimp.load("fp8_tensorwise").replace(fp8={"recipe": recipe},
                                                  loss_scale={"mode": "dynamic", "initial": 2.0 ** 10})
    x, y = _data()
    amp = unimp.apply(policy, NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    step = _nnx_step(amp, y)
    step(amp.model, amp.optimizer, x)
    before = jax.tree_util.tree_leaves(nnx.state((amp.model, amp.optimizer)))
    loss = step(amp.model, amp.optimizer, x.at[3, 5].set(jnp.inf))
    assert not np.isfinite(float(loss))
    assert amp.skipped_steps == 1
    after = jax.tree_util.tree_leaves(nnx.state((amp.model, amp.optimizer)))
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True))
               if not np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)]
    assert all(np.asarray(after[i]).size == 1 for i in changed)  # only the loss scale's counters move
    amp.remove()


def test_remove_restores_the_nnx_module_exactly():
    model = NnxMLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    amp = unimp.apply("fp8_delayed", model, optax.adam(1e-2))
    assert isinstance(model.fc1.unimp_fp8, fp8.Fp8Meta)
    amp.remove()
    assert not hasattr(model.fc1, fp8.NNX_ATTR) and type(model.fc1) is nnx.Linear
    graphdef2, state2 = nnx.split(model)
    assert graphdef2 == graphdef
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(state),
                                                    jax.tree_util.tree_leaves(state2), strict=True))


@pytest.mark.parametrize("case", fp8_cases(), ids=str)
def test_fp8_conformance(case, kit):
    run_case(case, kit)
