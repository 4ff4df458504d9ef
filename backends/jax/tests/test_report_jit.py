"""amp.report() after training only under jit (issue 27 item 11): nnx models trained through
``nnx.jit`` and linen models through ``jax.jit`` report every layer with the dtypes of the report
of the same model called eagerly (the layers record what they run while jit traces them)."""

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

X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.float32)


class Model(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 32, rngs=rngs)
        self.ln = nnx.LayerNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.ln(self.fc(x))))


def _apply(policy, model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return unimp.apply(policy, model, optax.adam(1e-2))


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16"])
def test_nnx_report_after_jit_training_equals_eager(policy):
    eager = _apply(policy, Model(nnx.Rngs(0)))
    eager.model(X)
    expected = eager.report().rows
    eager.remove()

    amp = _apply(policy, Model(nnx.Rngs(0)))

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads, _ = amp.value_and_grad(lambda m, x: (m(x).astype(jnp.float32) ** 2).mean())(optimizer, model, x)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(amp.model, amp.optimizer, X)) for _ in range(3)]
    assert losses[-1] < losses[0]
    report = amp.report()
    assert [r.path for r in report.rows] == [r.path for r in expected] and len(expected) >= 3
    assert report.rows == expected
    amp.remove()


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="head")(nn.LayerNorm(name="norm")(nn.Dense(32, name="fc")(x)))


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16"])
def test_linen_report_after_jit_training_lists_every_layer(policy):
    module = Mlp()
    params = module.init(jax.random.key(0), X)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply(policy, module, optax.adam(1e-2), params=params, inputs=X)
    expected = amp.report().rows  # before any step: what a forward of the example runs
    opt_state = amp.optimizer.init(amp.params)

    @jax.jit
    def step(params, opt_state, x):
        _, grads, _ = amp.value_and_grad(lambda p: (amp.apply(p, x).astype(jnp.float32) ** 2).mean())(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state

    params = amp.params
    for _ in range(3):
        params, opt_state = step(params, opt_state, X)
    report = amp.report(params=params)
    assert {r.path for r in report.rows} >= {"fc", "norm", "head"}
    assert report.rows == expected
    amp.remove()
