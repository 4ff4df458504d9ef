"""A failed ``unimp.apply`` leaves an nnx model exactly as it was (issue 27 item 4): every Variable
holds the same array (same bits, dtype), every module its class and attributes. The backend's
snapshot is checked against a complete apply (a failure anywhere restores a subset of that), and a
real failure half-way: a layer whose parameter cannot be cast, after earlier layers were."""

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import unimp
from unimp.backend import UnimpWarning
from unimp_jax.backend import JaxBackend


class Model(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(16, 16, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs), nnx.Linear(16, 16, rngs=rngs)])
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        x = self.ln(self.fc(x))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def state_of(model):
    """Every graph node: modules by identity and class and attribute names, variables by identity
    and value bits/dtype."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable):
            value = node.get_value()
            out.append((path, id(node), type(node).__name__, str(value.dtype), np.asarray(value).tobytes()))
        elif isinstance(node, nnx.Module):
            out.append((path, id(node), type(node), sorted(vars(node))))
    return out


def _apply(policy, model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return unimp.apply(policy, model, optax.adam(1e-3))


@pytest.mark.parametrize("policy", ["pure_bf16", "mixed_bf16", "fp16_master"])
def test_snapshot_covers_everything_apply_changes(policy):
    model = Model(nnx.Rngs(0))
    before = state_of(model)
    snap = JaxBackend().snapshot(model)
    amp = _apply(policy, model)
    assert state_of(model) != before  # apply changed classes (and, for pure_bf16, values)
    snap.restore()
    assert state_of(model) == before
    unimp.backend.applied.release(amp._applied_ids)
    np.asarray(model(jnp.ones((2, 16))))  # runs as the plain model




@pytest.mark.parametrize("error", [TypeError, KeyboardInterrupt])
def test_apply_failing_half_way_changes_nothing(error, monkeypatch):
    model = Model(nnx.Rngs(0))
    before = state_of(model)
    calls = []
    from unimp_jax import nnx_amp

    real = nnx_amp.NnxAmp._cast_params

    def cast_then_fail(self, parts, m, dtype):  # the real cast of every layer, then a failure at the head
        real(self, parts, m, dtype)
        calls.append(parts)
        if parts == ("head",):
            raise error("half-way")

    monkeypatch.setattr(nnx_amp.NnxAmp, "_cast_params", cast_then_fail)
    with pytest.raises(error):
        _apply("pure_bf16", model)
    assert len(calls) > 3 and state_of(model) == before
    assert not unimp.spi.Amp.is_bound(model)
    monkeypatch.undo()
    amp = _apply("pure_bf16", model)
    assert model.fc.kernel.get_value().dtype == jnp.bfloat16
    amp.remove()
    assert state_of(model) == before
