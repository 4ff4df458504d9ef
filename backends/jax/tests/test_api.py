"""The JAX Amp API on real Flax models: gradients, skips, checkpoints, layers, errors, remove()."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import unimp
from unimp.backend import UnimpWarning
from unimp.errors import UnsupportedError
from unimp_jax import LinenOp, Op
from unimp_jax.optimizer import find_state

X = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 16)), jnp.float32)


class AllLayers(nnx.Module):
    """One of each Flax layer kind unimp controls."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(32, 16, rngs=rngs)
        self.fc = nnx.Linear(16, 16, rngs=rngs)
        self.einsum = nnx.Einsum("btd,dh->bth", (16, 16), rngs=rngs)
        self.conv = nnx.Conv(16, 16, kernel_size=(3,), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)
        self.rms = nnx.RMSNorm(16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.gn = nnx.GroupNorm(16, num_groups=4, rngs=rngs)
        self.act = Op(jax.nn.gelu)
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = self.act(self.fc(x))
        x = self.conv(self.einsum(x))
        x = self.ln(self.attn(x))
        x = self.gn(self.bn(self.rms(x)))
        return self.head(x)


TOKENS = jnp.arange(16).reshape(2, 8) % 32


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16", "mixed_fp16"])
def test_every_flax_layer_follows_the_policy(policy):
    pol = unimp.load(policy).replace(overrides=[{"types": ["RMSNorm"], "compute_dtype": "bfloat16"},
                                                {"modules": ["hea*"], "compute_dtype": "float32"}])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply(pol, AllLayers(nnx.Rngs(0)), optax.adam(1e-3))
    try:
        report = amp.report(TOKENS)
        low = amp.plan.compute_dtype
        seen = {r.path: r for r in report.rows}
        assert set(seen) >= {"embed", "fc", "einsum", "conv", "attn", "attn.query", "ln", "rms", "bn", "gn",
                             "act", "head"}
        types = {".".join(map(str, k)): type(m).__name__ for k, m in nnx.iter_modules(amp.model)}
        prev = None
        for r in report.rows:
            want = pol.decide(r.path, r.kind, (types[r.path],), low)
            if want.compute_dtype is not None:
                assert r.compute_dtype == want.compute_dtype, r
            if r.path != "bn":
                assert r.output_dtype == r.compute_dtype, r
            if r.param_dtype is not None and r.kind != "attention":
                assert r.param_dtype == want.param_dtype, r
            prev = r
        assert prev is not None
        assert seen["rms"].compute_dtype == "bfloat16" and seen["head"].compute_dtype == "float32"
        # batch_norm in float32: fp32 math, output keeps the activation dtype (unimp.policy.ops meaning)
        assert seen["bn"].compute_dtype == "float32" and seen["bn"].output_dtype == seen["rms"].output_dtype
        # output_dtype "unchanged": the output is the head's (float32 by its override), not cast
        assert pol.output_dtype == "unchanged" and amp.model(TOKENS).dtype == jnp.dtype(seen["head"].output_dtype)
    finally:
        amp.remove()


def test_value_and_grad_unscales_and_jit_has_no_host_callbacks():
    pol = unimp.load({"extends": "fp32", "loss_scale": {"mode": "dynamic", "initial": 1024.0}})
    model = nnx.Linear(16, 4, rngs=nnx.Rngs(0))
    plain = nnx.grad(lambda m, x: (m(x) ** 2).mean())(model, X)
    amp = unimp.apply(pol, model, optax.sgd(0.1))
    loss_fn = lambda m, x: (m(x) ** 2).mean()

    def step(model, optimizer, x):
        loss, grads, finite = amp.value_and_grad(loss_fn)(optimizer, model, x)
        optimizer.update(model, grads)
        return loss, grads, finite

    graph, state = nnx.split((amp.model, amp.optimizer))
    text = str(jax.make_jaxpr(lambda st, x: step(*nnx.merge(graph, st), x))(state, X))
    assert "callback" not in text and "io_callback" not in text
    loss, grads, finite = nnx.jit(step)(amp.model, amp.optimizer, X)
    assert bool(finite) and float(loss) > 0
    np.testing.assert_allclose(grads["kernel"].get_value(), plain["kernel"].get_value(), rtol=1e-5)  # jit vs eager
    amp.remove()


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = LinenOp(jax.nn.relu, name="act")(nn.Dense(32, name="fc1")(x))
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(8, name="head")(x)


def _linen(policy, tx=None):
    module = Mlp()
    params = module.init(jax.random.key(0), X)["params"]
    params = jax.tree_util.tree_map(lambda p: p.at[..., 0].set(-0.0) if p.ndim == 1 else p, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return unimp.apply(policy, module, tx or optax.adam(1e-2), params=params, inputs=X)


@pytest.mark.parametrize("output", ["unchanged", "float32"])
def test_output_dtype_unchanged_keeps_the_last_layers_dtype_and_float32_casts(output):
    """``unchanged``: the output of a model ending in a Dense/Linear is what Flax's own mixed layer gives
    (``dtype=bfloat16``: bfloat16); ``float32``: cast. nnx and linen alike."""
    pol = unimp.load("mixed_bf16").replace(output_dtype=output)
    native = nn.Dense(8, dtype=jnp.bfloat16).init_with_output(jax.random.key(0), X)[0].dtype  # Flax's own
    want = native if output == "unchanged" else jnp.float32
    assert native == jnp.bfloat16
    assert _linen(pol).apply(_linen(pol).params, X).dtype == want
    model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 8, rngs=nnx.Rngs(1)))
    amp = unimp.apply(pol, model, optax.sgd(0.1))
    assert amp.model(X).dtype == want
    amp.remove()
    assert model(X).dtype == jnp.float32  # removed: the plain model again


def _linen_step(amp):
    @jax.jit
    def step(params, opt_state, x, poison):
        # the loss in float32 (the presets leave the head's float16 output as Flax gives it)
        loss_fn = lambda p: (amp.apply(p, x).astype(jnp.float32) ** 2).mean() * jnp.where(poison, jnp.inf, 1.0)
        _, grads, finite = amp.value_and_grad(loss_fn)(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state, finite

    return step


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("policy", ["mixed_fp16", "pure_bf16"])
def test_linen_skip_is_bit_identical_and_masters_match(policy):
    pol = unimp.load(policy).replace(loss_scale={"mode": "dynamic", "skip_nonfinite": True})
    amp = _linen(pol)
    step = _linen_step(amp)
    params, opt = step(amp.params, amp.opt_state, X, False)[:2]
    state = find_state(opt)
    p2, o2, finite = step(params, opt, X, True)
    assert not bool(finite)
    inner = lambda o: (find_state(o).inner, find_state(o).master)
    assert _bits(p2) == _bits(params) and _bits(inner(o2)) == _bits(inner(opt))
    assert float(find_state(o2).loss_scale.scale) == float(state.loss_scale.scale) * 0.5
    # optax.apply_updates with the -0.0 updates of a skipped step is the identity too (signed zeros kept)
    updates, _ = amp.optimizer.update(jax.tree_util.tree_map(lambda g: g * jnp.nan, params), opt, params)
    assert _bits(optax.apply_updates(params, updates)) == _bits(params)
    if amp.masters() is not None:
        cast = jax.tree_util.tree_map(lambda m, p: m.astype(p.dtype), find_state(opt).master, params)
        assert _bits(cast) == _bits(params)
        assert params["fc1"]["kernel"].dtype == jnp.bfloat16 and params["norm"]["scale"].dtype == jnp.float32


def test_opt_state_checkpoint_round_trip_continues_identically():
    amp = _linen(unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 2}))
    step = _linen_step(amp)
    params, opt = amp.params, amp.opt_state
    for poison in (False, True, False):
        params, opt, _ = step(params, opt, X, poison)
    blob = serialization.to_bytes((params, opt))
    target = (amp.params, amp.tx.init(amp.original_params))
    params2, opt2 = serialization.from_bytes(target, blob)
    assert _bits(opt2) == _bits(opt)
    for poison in (False, False, True):
        params, opt, _ = step(params, opt, X, poison)
        params2, opt2, _ = step(params2, opt2, X, poison)
    assert _bits((params2, opt2)) == _bits((params, opt))
    amp.opt_state = opt
    assert amp.state_dict()["skipped"] == 2 and amp.state_dict()["steps"] == 6


def test_auto_is_float32_on_cpu_and_explicit_bf16_warns():
    plan = unimp.get_backend("jax").compile(unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto"}))
    assert plan.compute_dtype == "float32" and "XLA:CPU" in plan.compute_reason
    with pytest.warns(UnimpWarning, match="XLA:CPU runs slower"):
        amp = unimp.apply("mixed_bf16", nnx.Linear(16, 16, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    amp.remove()


def test_bad_input_is_a_clear_error():
    model = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="optimizer is Optimizer.*optax"):
        unimp.apply("fp32", model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    with pytest.raises(TypeError, match="unknown option.*params"):
        unimp.apply("fp32", model, optax.sgd(0.1), params={})
    with pytest.raises(TypeError, match="needs params and inputs"):
        unimp.apply("fp32", Mlp(), optax.sgd(0.1))
    with pytest.raises(UnsupportedError, match="growth_factor = 1.1"):
        unimp.apply({"extends": "mixed_fp16", "loss_scale": {"growth_factor": 1.1}}, model, optax.sgd(0.1))
    with pytest.raises(ValueError, match="kind=.*canonical"):
        Op(lambda x: x, kind="matmull")
    with pytest.raises(TypeError, match="no unimp backend accepts"):
        unimp.apply("fp32", object(), optax.sgd(0.1))
    assert type(model) is nnx.Linear  # nothing applied by the failed calls


def test_nnx_remove_after_training_keeps_trained_masters_and_restores_classes():
    model = AllLayers(nnx.Rngs(0))
    before = {k: v.get_value().dtype for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply("pure_bf16", model, optax.adam(1e-2))
    assert model.fc.kernel.get_value().dtype == jnp.bfloat16 and model.ln.scale.get_value().dtype == jnp.float32

    @nnx.jit
    def step(model, optimizer, t):
        _, grads, _ = amp.value_and_grad(lambda m, t: (m(t) ** 2).mean())(optimizer, model, t)
        optimizer.update(model, grads)

    for _ in range(2):
        step(amp.model, amp.optimizer, TOKENS)
    assert int(amp.optimizer.step.get_value()) == 2
    masters = dict(nnx.to_flat_state(amp.masters()))
    restored = amp.remove()
    assert restored is model and type(model.fc) is nnx.Linear and type(model) is AllLayers
    after = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert {k: v.get_value().dtype for k, v in after.items()} == before
    np.testing.assert_array_equal(after[("fc", "kernel")].get_value(), masters[("fc", "kernel")])
    with pytest.raises(RuntimeError, match="already"):
        amp2 = unimp.apply("fp32", model, optax.sgd(0.1))
        unimp.apply("fp32", model, optax.sgd(0.1))
    amp2.remove()


def test_mixed_fp16_starts_where_flax_dynamic_scale_starts():
    """``loss_scale.initial = "auto"`` (the default) on JAX: Flax's own ``DynamicScale()`` is the oracle."""
    from flax.training.dynamic_scale import DynamicScale

    amp = unimp.apply("mixed_fp16", nnx.Linear(16, 4, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    assert amp.scale == amp.plan.loss_scale.initial == float(DynamicScale().scale)
    amp.remove()
