"""Loss scaling at its bounds on the JAX backend (issue 27 item 8, issue 24): a state with every counter
at the int32 bound loads and steps through a real jitted nnx/Linen training step as the reference
:class:`unimp.LossScale` does; a float64 scale (jax_enable_x64) runs below 2**-126 exactly, where it
is a normal number; a knob the device cannot honour is refused, never run silently."""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import unimp
from unimp.backend import UnimpWarning
from unimp.conformance.state_dicts import check_counters_at_bound
from unimp.errors import UnsupportedError
from unimp.loss_scale import LossScale
from unimp.policy.spec import INT32_MAX
from unimp_jax.scaler import check, initial_tree, to_state, update_tree

X = jnp.ones((2, 8), jnp.float32)


def _nnx(policy):
    amp = unimp.apply(policy, nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1))

    @nnx.jit
    def step(model, optimizer, x):
        _, grads, _ = amp.value_and_grad(lambda m, x: m(x).mean())(optimizer, model, x)
        optimizer.update(model, grads)

    return amp, lambda a, finite: step(a.model, a.optimizer, X * (1.0 if finite else jnp.inf))


def _linen(policy):
    module = nn.Dense(8)
    params = module.init(jax.random.key(0), X)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply(policy, module, optax.sgd(0.1), params=params, inputs=X)

    @jax.jit
    def train(params, opt_state, x):
        _, grads, _ = amp.value_and_grad(lambda p: amp.apply(p, x).mean())(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state

    def step(a, finite):
        a.params, a.opt_state = train(a.params, a.opt_state, X * (1.0 if finite else jnp.inf))

    return amp, step


@pytest.mark.parametrize("api,policy", [("nnx", "mixed_fp16"), ("nnx", "flax_dynamic_scale"),
                                        ("linen", "megatron_fp16")], ids=str)
@pytest.mark.parametrize("finite", [True, False])
def test_counters_at_the_int32_bound_step_as_the_reference(api, policy, finite):
    """The issue's case: growth_tracker 2**31 - 1 grew nowhere (int32 tracker + 1 wrapped to -2**31)
    and the Amp then refused its own state dict."""
    amp, step = {"nnx": _nnx, "linen": _linen}[api](policy)
    st = check_counters_at_bound(amp, step, finite)
    assert (st.steps, st.skipped) == (INT32_MAX, INT32_MAX)
    if finite:
        assert st.growth_tracker == 0 and st.scale > 1024.0  # loaded at 1024 (check_counters_at_bound): it grows
    amp.remove()


@pytest.fixture
def x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", before)


def test_a_float64_scale_runs_below_float32s_smallest_normal(x64):
    """scale_dtype = "float64" holds 8.8e-39 as a normal number: the jitted rule follows the reference
    through it (it stopped at 2**-126 before), down to the floor."""
    spec = unimp.load("deepspeed_fp16").replace(loss_scale={"initial": 2.0 ** -120, "min": 2.0 ** -140,
                                                            "growth_interval": 2}).loss_scale
    seq = [False] * 12 + [True] * 6 + [False] * 20
    step = jax.jit(lambda t, f: update_tree(spec, t, f))
    tree, got = initial_tree(spec), []
    for f in seq:
        tree = step(tree, jnp.asarray(f))
        check(tree, spec)
        got.append(float(np.asarray(tree.scale)))
    want = [o.scale for o in LossScale(spec).replay(seq)]
    assert tree.scale.dtype == jnp.float64 and got == want
    assert min(want) == 2.0 ** -140 < 2.0 ** -126  # float32 would stop (or flush) at 2**-126 on XLA:CPU


def test_float64_without_x64_is_refused_not_run_in_float32():
    if jax.config.jax_enable_x64:
        pytest.skip("jax_enable_x64 is on")
    spec = unimp.load("deepspeed_fp16").loss_scale
    with pytest.raises(UnsupportedError, match=r"scale_dtype = 'float64' cannot be honoured.*jax_enable_x64"):
        update_tree(spec, initial_tree(dataclasses.replace(spec, scale_dtype="float32")), jnp.asarray(True))
    with pytest.raises(UnsupportedError, match="jax_enable_x64"):
        unimp.apply("deepspeed_fp16", nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1))


def test_a_subnormal_initial_is_declared_where_the_device_reads_it_as_0():
    from unimp_jax.scaler import flushes_subnormals, validate

    spec = unimp.load("mixed_fp16").replace(loss_scale={"initial": 2.0 ** -140, "min": 0.0}).loss_scale
    if not flushes_subnormals():
        pytest.skip("this device keeps float32 subnormals")
    with pytest.raises(UnsupportedError, match=r"loss_scale.initial = .* reads a float32 scale below 2\^-126 as 0"):
        validate(spec, "test policy")
    assert to_state(initial_tree(dataclasses.replace(spec, initial=2.0 ** -126))).scale == 2.0 ** -126
