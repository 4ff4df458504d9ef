"""Garbage state dicts through the JAX Amps (NNX and Linen): one StateError, nothing applied (issue 14)."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import unimp
from unimp.backend import UnimpWarning
from unimp.conformance.state_dicts import amp_checks, check_removed

X = jnp.ones((2, 8), jnp.float32)


def _nnx(policy):
    return unimp.apply(policy, nnx.Linear(8, 8, rngs=nnx.Rngs(0)), optax.sgd(0.1))


def _linen(policy):
    module = nn.Dense(8)
    params = module.init(jax.random.key(0), X)["params"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return unimp.apply(policy, module, optax.sgd(0.1), params=params, inputs=X)


CASES = [("nnx", "mixed_fp16"), ("nnx", "flax_dynamic_scale"), ("linen", "mixed_fp16"), ("linen", "megatron_fp16")]


@pytest.fixture(scope="module", params=CASES, ids=str)
def amp(request):
    api, policy = request.param
    a = {"nnx": _nnx, "linen": _linen}[api](policy)
    yield a
    a.remove()


(test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
 test_deepcopy_of_the_amp_works_or_is_refused_clearly) = amp_checks()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_removed_amp_refuses(case):
    check_removed({"nnx": _nnx, "linen": _linen}[case[0]](case[1]))
