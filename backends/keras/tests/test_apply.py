"""unimp.apply on real Keras models: model styles, both training styles, remove, bad input."""


import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
from keras import ops

import unimp
from unimp.conformance import cast_like
from unimp.policy.ops import kind_of
from unimp_keras.ops import NATIVE_OPS
from unimp_keras.steps import custom_step

X = np.random.default_rng(0).normal(size=(32, 12)).astype("float32")
Y = (X[:, :4].sum(-1) > 0).astype("int32")


def sequential():
    return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, name="fc1"),
                             keras.layers.ReLU(name="act"), keras.layers.LayerNormalization(name="norm"),
                             keras.layers.Dense(2, name="head")], name="seq")


def functional():
    inp = keras.Input((12,))
    a = keras.layers.Dense(16, name="fc1")(inp)
    b = keras.layers.Dense(16, name="skip", dtype="float32")(inp)
    x = keras.layers.Add(name="add")([keras.layers.ReLU(name="act")(a), b])
    return keras.Model(inp, keras.layers.Dense(2, name="head")(x), name="func")


class Block(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.fc = keras.layers.Dense(16, name="fc")
        self.act = keras.layers.ReLU(name="act")

    def call(self, x):
        return self.act(self.fc(x))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.block = Block(name="block")
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(x))


def build(factory):
    m = factory()
    m(X[:2])
    return m


def keras_output_dtype(factory, policy="mixed_bfloat16"):
    """Keras' own answer: the model built under its ``policy`` (Layer.__call__ returns the last layer's
    compute dtype; nothing casts the model's outputs)."""
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        return keras.backend.standardize_dtype(build(factory)(X[:2]).dtype)
    finally:
        keras.config.set_dtype_policy(old)


def expected(policy, path, layer):
    """The core's decision for one layer (follow-inputs layers checked separately)."""
    names = tuple(c.__name__ for c in type(layer).__mro__)
    kind = next((k for k in map(lambda n: kind_of(n, NATIVE_OPS), names) if k), None)
    return policy.decide(path, kind, names, "bfloat16")


@pytest.mark.parametrize("factory", [sequential, functional, Subclassed], ids=lambda f: f.__name__)
def test_fit_and_report_and_remove(factory):
    policy = unimp.load("mixed_bf16")
    model = build(factory)
    weights = [w.numpy().copy() for w in model.weights]
    before = ops.convert_to_numpy(model(X))
    opt = keras.optimizers.Adam(1e-2)
    amp = unimp.apply(policy, model, opt)
    report = amp.report(X[:2])
    for row in report.rows[:-1]:
        want = expected(policy, row.path, next(u.layer for u in amp._binding.units if u.path == row.path))
        if want.compute_dtype is not None:
            assert row.compute_dtype == want.compute_dtype, row
        # inside a subclassed block on TensorFlow (no promotion in its operators), results come back in the
        # block's (input) dtype, float32 here; JAX and torch promote, so results stay in their compute dtype
        tf = keras.backend.backend() == "tensorflow"
        inside = row.path.startswith("block.") and tf
        # the block itself returns what its last layer returned: act's bfloat16 where nothing casts it back
        returned = "bfloat16" if row.path == "block" and not tf else row.compute_dtype
        assert row.output_dtype == ("float32" if inside else returned), row
    native = keras_output_dtype(factory)
    assert report.rows[-1].output_dtype == native == "bfloat16"  # output_dtype "unchanged": Keras' own
    follow = {r.path: r.compute_dtype for r in report.rows if r.kind == "activation"}  # act follows its input
    inside = "float32" if keras.backend.backend() == "tensorflow" else "bfloat16"  # fc's result, as it arrives
    assert follow == ({"block.act": inside} if factory is Subclassed else {"act": "bfloat16"})
    amp.model.compile(optimizer=amp.optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = amp.model.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    assert amp.state_dict()["steps"] == 4 and int(ops.convert_to_numpy(opt.iterations)) == 4
    assert keras.backend.standardize_dtype(amp.model(X).dtype) == native
    trained = [w.numpy().copy() for w in model.weights]
    assert any(not np.array_equal(a, b) for a, b in zip(weights, trained))
    restored = amp.remove()
    assert restored is model and "call" not in vars(model)
    assert all(w.dtype == "float32" for w in model.weights)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(trained, model.weights))  # training kept
    assert all(layer.compute_dtype == "float32" for layer in model._flatten_layers())
    assert not np.array_equal(before, ops.convert_to_numpy(model(X)))  # trained, and in float32 again


@pytest.mark.parametrize("output", ["unchanged", "float32"])
def test_output_dtype_unchanged_is_keras_own_and_float32_casts(output):
    model = build(functional)
    amp = unimp.apply(unimp.load("mixed_bf16").replace(output_dtype=output), model, keras.optimizers.SGD(0.1))
    want = keras_output_dtype(functional) if output == "unchanged" else "float32"
    assert keras.backend.standardize_dtype(amp.model(X).dtype) == want and want != ("float32" if output ==
                                                                                    "unchanged" else "")
    amp.remove()
    assert "call" not in vars(model) and keras.backend.standardize_dtype(model(X).dtype) == "float32"


def test_promote_layer_runs_in_widest_input():
    amp = unimp.apply("mixed_bf16", build(functional), keras.optimizers.SGD(0.1))
    rows = {r.path: r for r in amp.report(X[:2]).rows}
    assert rows["skip"].compute_dtype == "bfloat16"  # linear is in `lower`, whatever dtype= it was built with
    amp.remove()
    pol = unimp.load({"extends": "mixed_bf16", "overrides": [{"modules": ["skip"], "compute_dtype": "float32"}]})
    amp = unimp.apply(pol, build(functional), keras.optimizers.SGD(0.1))
    rows = {r.path: r for r in amp.report(X[:2]).rows}
    assert (rows["act"].compute_dtype, rows["skip"].compute_dtype) == ("bfloat16", "float32")
    assert rows["add"].compute_dtype == "float32" and rows["add"].output_dtype == "float32"  # widest
    amp.remove()


def _sparse_ce(out, y):
    # the presets leave the head's output in its compute dtype, as Keras does: the loss in float32
    # (Keras' mixed precision guide casts the outputs to float32 for a custom loop's loss)
    logits = ops.cast(out, "float32")
    return ops.mean(ops.sparse_categorical_crossentropy(y, logits, from_logits=True))


@pytest.mark.parametrize("policy", ["mixed_fp16", "pure_bf16"])
def test_custom_loop_skips_bit_exactly(policy):
    """Each Keras backend's own custom step (a tf.function / jitted JAX / torch step, unimp_keras.steps)."""
    pol = unimp.load(policy).replace(loss_scale={"mode": "dynamic", "skip_nonfinite": True,
                                                 "growth_interval": 2, "initial": 256.0})
    model = build(sequential)
    opt = keras.optimizers.Adam(1e-2)
    amp = unimp.apply(pol, model, opt)
    ref = unimp.LossScale(pol.loss_scale)
    state = ref.initial_state()
    for poison in (False, True, False, False, True):
        snap = [v.numpy().copy() for v in (*model.weights, *opt.variables)]
        custom_step(amp, _sparse_ce, X[:16], Y[:16], poison)
        state = ref.update(state, not poison).state
        assert (amp.scale, amp.skipped_steps) == (state.scale, state.skipped)
        if poison:
            after = [v.numpy() for v in (*model.weights, *opt.variables)]
            assert all(np.array_equal(a, b) for a, b in zip(snap, after))  # params, slots, iterations
    assert int(ops.convert_to_numpy(opt.iterations)) == 3
    if pol.uses_master_weights:
        pairs = amp.master_pairs()
        assert {n for n, _, _ in pairs} == {"fc1.kernel", "fc1.bias", "head.kernel", "head.bias"}
        for _, low, master in pairs:
            assert np.array_equal(low, cast_like(master, "bfloat16"))
    amp.remove()
    assert all(w.dtype == "float32" for w in model.weights)


def test_pure_bf16_fit_keeps_float32_masters():
    model = build(sequential)
    opt = keras.optimizers.Adam(1e-2)
    amp = unimp.apply("pure_bf16", model, opt)
    dtypes = {r.path: r.param_dtype for r in amp.report(X[:2]).rows}
    assert dtypes == {"fc1": "bfloat16", "act": None, "norm": "float32", "head": "bfloat16", "": None}
    amp.model.compile(optimizer=amp.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    amp.model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert all(m.dtype == "float32" for v in opt.variables for m in [v] if "momentum" in v.path)
    for _, low, master in amp.master_pairs():
        assert np.array_equal(low, cast_like(master, "bfloat16"))
    masters = {n: m.copy() for n, _, m in amp.master_pairs()}
    amp.remove()
    assert np.array_equal(model.get_layer("fc1").kernel.numpy(), masters["fc1.kernel"])


def test_compiled_model_gets_the_wrapper_and_gets_it_back():
    model = build(sequential)
    opt = keras.optimizers.SGD(0.1)
    model.compile(optimizer=opt, loss="mse")
    amp = unimp.apply("mixed_fp16", model, opt)
    assert model.optimizer is amp.optimizer and opt.loss_scale_factor is None
    amp.remove()
    assert model.optimizer is opt


def test_keras_mixed_float16_uses_keras_own_optimizer():
    if keras.backend.backend() == "torch":  # Keras' float32 scale keeps subnormals on torch (IEEE multiply),
        # keras_mixed_float16 says "flush": not Keras' rule there, so unimp's optimizer runs the preset
        amp = unimp.apply("keras_mixed_float16", build(sequential), keras.optimizers.SGD(0.1))
        assert type(amp.optimizer).__name__ == "AmpOptimizer"
        same = unimp.load("keras_mixed_float16").replace(loss_scale={"subnormal": "keep"})
        amp.remove()
        amp = unimp.apply(same, build(sequential), keras.optimizers.SGD(0.1))
    else:
        amp = unimp.apply("keras_mixed_float16", build(sequential), keras.optimizers.SGD(0.1))
    assert type(amp.optimizer).__name__ == "KerasAmpOptimizer"
    assert isinstance(amp.optimizer, keras.optimizers.LossScaleOptimizer)
    assert amp.scale == 32768.0
    amp.remove()
    with pytest.raises(unimp.UnsupportedError, match="native_loss_scale"):
        unimp.apply("mixed_fp16", build(sequential), keras.optimizers.SGD(0.1), native_loss_scale=True)


def test_bad_input_is_a_clear_error_and_changes_nothing():
    model = build(sequential)
    with pytest.raises(TypeError, match="keras.optimizers.Optimizer"):
        unimp.apply("mixed_bf16", model, "adam")
    with pytest.raises(TypeError, match="inner_optimizer"):
        unimp.apply("mixed_bf16", model, keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    with pytest.raises(TypeError, match="unknown option"):
        unimp.apply("mixed_bf16", model, None, nativ_loss_scale=True)
    with pytest.raises(ValueError, match="not built"):
        unimp.apply("mixed_bf16", keras.Sequential([keras.layers.Dense(3)]))
    with pytest.raises(TypeError, match="Keras 3 keras.Model"):
        unimp.get_backend("keras").apply(unimp.get_backend("keras").compile(unimp.load("fp32")),
                                              keras.layers.Dense(3))
    with pytest.raises(unimp.UnsupportedError, match="fc1: input_dim=12"):
        unimp.apply({"extends": "mixed_bf16", "layout": {"on_misaligned": "error"}}, model)
    amp = unimp.apply("mixed_bf16", model)
    with pytest.raises(ValueError, match="no optimizer"):
        amp.apply_gradients([])
    amp.remove()
    assert all(layer.dtype_policy.name == "float32" for layer in model.layers) and "call" not in vars(model)


def test_layout_findings_name_the_layer():
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, data_format="channels_first", name="conv_cf")(inp)
    model = keras.Model(inp, keras.layers.Conv2D(8, 1, name="conv_ok")(inp))
    model2 = keras.Model(inp, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp = unimp.apply("mixed_bf16", model2)
    assert any("conv_cf: data_format='channels_first'" in f for f in amp.findings)
    assert any("conv_cf: filters=4 is not a multiple of 8" in str(w.message) for w in caught)
    assert amp.data_formats == {"conv_cf": "channels_first"}
    amp.remove()
    amp = unimp.apply("mixed_bf16", model)
    assert not [f for f in amp.findings if "data_format" in f] and amp.data_formats == {"conv_ok": "channels_last"}
    amp.remove()


def test_scope_builds_under_the_policy_and_restores_globals():
    import unimp_keras

    with unimp_keras.scope("pure_bf16") as s:
        model = sequential()
        assert keras.config.dtype_policy().name == "bfloat16"
    assert keras.config.dtype_policy().name == "float32"
    assert model.get_layer("fc1").kernel.dtype == "bfloat16"  # created in bf16, no copy
    amp = s.apply(model, keras.optimizers.SGD(0.1))
    assert amp.report(X[:2]).row("norm").compute_dtype == "float32"
    amp.remove()


def test_importing_the_backend_imports_no_framework():
    code = ("import sys, unimp, unimp_keras, unimp_keras.backend; unimp.backends(); "
            "print([m for m in ('tensorflow', 'keras') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
