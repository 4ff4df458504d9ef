"""Several optax optimizers on one Flax model, one loss scale, side by side with a hand-written jmp loop.

JAX's idiom for "one optimizer per part of the model" (fine-tuning a pretrained body slowly and a new
head fast, Flax's and optax's docs) is one transformation: ``optax.multi_transform({"body": sgd, "head":
adam}, labels)``. unimp wraps it as any optax transformation, so both optimizers share one loss scale and
one finiteness check per step, as jmp's ``DynamicLossScale`` does around the same transformation in a
hand-written step (``scale``, ``unscale``, ``all_finite``, ``adjust``, ``select_tree``). Separate models
(a GAN's generator and discriminator, each its own ``TrainState``) get one Amp each, as each Flax
``TrainState`` keeps its own ``DynamicScale``. A list of transformations for one model has no labels to
tell which parameters each steps: refused naming ``optax.multi_transform``.
"""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp
from unimp.backend import UnimpWarning
from unimp.errors import UnsupportedError

jmp = pytest.importorskip("jmp")


class BodyAndHead(nn.Module):
    dtype: object = None  # the native run's compute dtype (jmp's Policy compute dtype), unimp's run: None

    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(32, dtype=self.dtype, name="body")(x))
        return nn.Dense(4, dtype=self.dtype, name="head")(x)


def two_optimizers():
    """A slow SGD for the body, a fast Adam for the head: optax's one transformation for both."""
    def labels(params):  # each top-level module's name for all its leaves
        return {k: jax.tree_util.tree_map(lambda _, k=k: k, v) for k, v in params.items()}

    return optax.multi_transform({"body": optax.sgd(0.05), "head": optax.adam(1e-2)}, labels)


def batches(n, poison=()):
    g = np.random.default_rng(0)
    out = []
    for i in range(n):
        x, y = g.normal(size=(8, 16)).astype("float32"), g.normal(size=(8, 4)).astype("float32")
        out.append((jnp.asarray(x), jnp.asarray(y * (np.inf if i in poison else 1.0))))
    return out


def mse(out, y):
    return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def native_run(params, data):
    """jmp's recipe: fp16 compute, fp32 params and output, DynamicLossScale around the one transformation."""
    module, tx = BodyAndHead(jnp.float16), two_optimizers()
    scale = jmp.DynamicLossScale(jnp.float32(2.0 ** 15))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, scale, x, y):
        grads = jax.grad(lambda p: scale.scale(mse(module.apply({"params": p}, x), y)))(params)
        grads = scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_state = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_state)
        params, opt_state = jmp.select_tree(finite, new, (params, opt_state))
        return params, opt_state, scale.adjust(finite)

    for x, y in data:
        params, opt_state, scale = step(params, opt_state, scale, x, y)
    return params, float(scale.loss_scale)


def unimp_run(params, data):
    module = BodyAndHead()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)  # explicit float16 on XLA:CPU runs as asked
        amp = unimp.apply("jmp_float16", module, two_optimizers(), params=params, inputs=data[0][0])

    @jax.jit
    def step(params, opt_state, x, y):
        _, grads, _ = amp.value_and_grad(lambda p: mse(amp.apply(p, x), y))(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state

    params, opt_state = amp.params, amp.opt_state
    for x, y in data:
        params, opt_state = step(params, opt_state, x, y)
    amp.params, amp.opt_state = params, opt_state
    return params, amp


@pytest.mark.parametrize("poison", [(), (1,)])
def test_fine_tuning_body_and_head_multi_transform_matches_jmp_bitwise(poison):
    """Fine-tuning with two optimizers (SGD body, Adam head) as one optax.multi_transform: unimp's jmp_float16
    equals jmp's hand-written step around the same transformation bit for bit, parameters and scale, a step
    with non-finite gradients skipped for both optimizers (one loss scale, one backoff). Both steps run op by op
    (jax.disable_jit): jitted, XLA:CPU fuses the two (different) programs differently and Adam's update then
    differs in the last bit of float32 from the second step on."""
    data = batches(4, poison)
    params = BodyAndHead().init(jax.random.key(0), data[0][0])["params"]
    with jax.disable_jit():
        native, native_scale = native_run(params, data)
        ours, amp = unimp_run(params, data)
    leaves = jax.tree_util.tree_leaves
    assert all(np.array_equal(a, b) for a, b in zip(leaves(ours), leaves(native), strict=True))
    assert amp.scale == native_scale == (2.0 ** 14 if poison else 2.0 ** 15)
    assert (amp.skipped_steps, amp.state_dict()["steps"]) == (len(poison), 4)
    amp.remove()


def test_a_list_of_optax_optimizers_refused_naming_multi_transform():
    module = BodyAndHead()
    x = batches(1)[0][0]
    params = module.init(jax.random.key(0), x)["params"]
    with pytest.raises(UnsupportedError, match=r"2 optax transformations for one model.*optax.multi_transform"):
        unimp.apply("mixed_bf16", module, [optax.sgd(0.1), optax.adam(1e-3)], params=params, inputs=x)
