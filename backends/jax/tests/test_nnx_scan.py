"""Flax nnx ``nnx.scan`` over a stack whose blocks end in a LayerNorm: the carry check of
``jax.lax.scan`` is a located unimp error naming both fixes, and each fix runs (issue 27, item 15's
nnx sibling: the body is the user's function, so unimp cannot cast the carry itself)."""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import unimp
from unimp.spi import UnsupportedError


class Block(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, x):
        return self.norm(x + self.lin(x))


class Stack(nnx.Module):
    def __init__(self, rngs, cast_back=False):
        self.inp = nnx.Linear(8, 16, rngs=rngs)  # lowered: the carry enters the scan in the low dtype
        self.cast_back = cast_back

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        cast_back = self.cast_back

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            y = block(x)
            return y.astype(x.dtype) if cast_back else y

        return body(self.inp(x), self.blocks)


X = jnp.ones((2, 8))


def test_a_carry_changed_by_the_policy_is_a_located_error_naming_the_fixes():
    amp = unimp.apply("mixed_bf16", Stack(nnx.Rngs(0)), optax.adam(1e-3))
    with pytest.raises(UnsupportedError, match=r"nnx.scan body .*bfloat16\[2,16\].*float32\[2,16\].*"
                                               r"astype\(x.dtype\).*overrides = "):
        amp.model(X)
    amp.remove()


@pytest.mark.parametrize("fix", ["cast_back", "override"])
def test_each_named_fix_runs(fix):
    policy = unimp.load({"extends": "mixed_bf16", **({"overrides": [
        {"modules": ["blocks.norm"], "compute_dtype": "bfloat16"}]} if fix == "override" else {})})
    amp = unimp.apply(policy, Stack(nnx.Rngs(0), cast_back=fix == "cast_back"), optax.adam(1e-3))
    out = amp.model(X)
    # the carry keeps the dtype it entered with (the lowered `inp`'s bfloat16); mixed_bf16 leaves outputs unchanged
    assert out.dtype == jnp.bfloat16 and bool(jnp.isfinite(out).all())
    amp.remove()
