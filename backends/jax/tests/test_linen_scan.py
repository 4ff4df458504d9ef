"""Flax linen ``nn.scan`` stacks keep their carry's dtype under every low-precision preset (issue 27,
item 15: a lowered Dense feeds the carry, a float32 LayerNorm hands it back, ``jax.lax.scan``
refused with "carry ... must have equal types").

Oracle: the same stack written with Flax's own mixed precision (``dtype=`` on each module, the carry
cast back to its dtype at the end of the body: what ``jax.lax.scan`` requires of a hand-written
model), run on the same params.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import unimp

LOW = {"mixed_bf16": jnp.bfloat16, "pure_bf16": jnp.bfloat16, "mixed_fp16": jnp.float16}


class Block(nn.Module):
    dtype: object = None  # None: full precision (what unimp is applied to); else Flax's own mixed precision

    @nn.compact
    def __call__(self, x, _):
        h = nn.gelu(nn.Dense(16, dtype=self.dtype)(x))
        y = nn.LayerNorm(dtype=jnp.float32 if self.dtype else None)(x + nn.Dense(16, dtype=self.dtype)(h))
        return (y.astype(x.dtype) if self.dtype else y), None  # by hand: the carry keeps its dtype


class Stack(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dtype=self.dtype)(x)  # lowered: the carry enters scan in the low dtype
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan(dtype=self.dtype, name="blocks")(x, None)
        return nn.Dense(4, dtype=self.dtype)(x).astype(jnp.float32)


X = jax.random.normal(jax.random.key(1), (4, 8))
Y = jax.random.normal(jax.random.key(2), (4, 4))


@pytest.mark.parametrize("preset", sorted(LOW))
def test_scan_carry_keeps_its_dtype_as_flax_own_mixed_precision_does(preset):
    module = Stack()
    params = module.init(jax.random.key(0), X)["params"]
    amp = unimp.apply(preset, module, optax.adam(1e-3), params=params, inputs=X)
    got = amp.apply(amp.params, X)
    want = Stack(dtype=LOW[preset]).apply({"params": amp.params}, X)  # the same (cast) params
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    rows = {r.path: r for r in amp.report().rows}
    low = jnp.dtype(LOW[preset]).name
    assert rows["blocks.Dense_0"].compute_dtype == low and rows["blocks.LayerNorm_0"].compute_dtype == "float32"

    @jax.jit
    def step(params, opt_state):
        loss, grads, finite = amp.value_and_grad(lambda p: jnp.mean((amp.apply(p, X) - Y) ** 2))(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state, loss, finite

    p, s = amp.params, amp.opt_state
    losses = []
    for _ in range(3):
        p, s, loss, finite = step(p, s)
        losses.append(float(loss))
        assert bool(finite)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    amp.remove()


def test_a_scan_whose_body_keeps_the_dtype_itself_is_left_alone():
    """A carry that already comes back in its own dtype is not touched (a float32 run stays exact)."""
    module = Stack()
    params = module.init(jax.random.key(0), X)["params"]
    amp = unimp.apply("fp32", module, optax.sgd(0.1), params=params, inputs=X)
    np.testing.assert_array_equal(np.asarray(amp.apply(amp.params, X)), np.asarray(module.apply({"params": params}, X)))
    amp.remove()


class RematStack(nn.Module):
    """The same stack with a rematerialised body (``nn.scan(nn.remat(Block))``, as long stacks are
    written to save memory): jax.checkpoint's frames sit between lift.scan and the body."""

    dtype: object = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, dtype=self.dtype)(x)
        scan = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan(dtype=self.dtype, name="blocks")(x, None)
        return nn.Dense(4, dtype=self.dtype)(x).astype(jnp.float32)


@pytest.mark.parametrize("preset", ["mixed_bf16", "mixed_fp16"])
def test_a_rematerialised_scan_body_keeps_its_carry_dtype(preset):
    module = RematStack()
    params = module.init(jax.random.key(0), X)["params"]
    amp = unimp.apply(preset, module, optax.adam(1e-3), params=params, inputs=X)
    got = amp.apply(amp.params, X)
    want = RematStack(dtype=LOW[preset]).apply({"params": amp.params}, X)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    amp.remove()


def test_a_carry_unimp_cannot_keep_is_a_located_error_with_the_fix():
    """A body lifted so many times (12 nested ``nn.remat``) that unimp does not find it as the scan body:
    jax.lax.scan's carry check becomes unimp's located error naming both fixes, not a raw TypeError."""

    class Body(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.LayerNorm()(x + nn.Dense(16)(x)), None

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = Body
            for _ in range(12):
                body = nn.remat(body)
            scan = nn.scan(body, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
            return scan(name="blocks")(nn.Dense(16)(x), None)[0]

    module = Deep()
    amp = unimp.apply("mixed_bf16", module, optax.sgd(0.1), params=module.init(jax.random.key(0), X)["params"],
                      inputs=X)
    with pytest.raises(unimp.errors.UnsupportedError, match=r"an nn\.scan body hands its carry back .*cast the "
                       r"carry back at the end of the body.*overrides"):
        amp.apply(amp.params, X)
    amp.remove()
