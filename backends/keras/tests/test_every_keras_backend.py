"""The issue's must-holds on every Keras backend this suite runs under (KERAS_BACKEND = tensorflow, jax, torch).

Expected values come from Keras itself: a twin model with Keras' own dtype policies set by hand
(``mixed_bfloat16`` / ``mixed_float16``) and ``keras.optimizers.LossScaleOptimizer``, driven by the same
batches, the same planted non-finite steps and each backend's own custom step."""

import json
import types

import keras
import numpy as np
import pytest

import unimp
from unimp_keras.steps import custom_step

RNG = np.random.RandomState(0)
X = RNG.randn(32, 8).astype("float32")
Y = RNG.randn(32, 2).astype("float32")


def snippet(dtype=None):
    kw = {} if dtype is None else {"dtype": dtype}
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="fc1", **kw),
                             keras.layers.Dense(2, name="fc2", **kw)])


def twin(model, dtype):
    """``model``'s architecture with Keras' own ``dtype`` policy on every layer, the same weights."""
    ref = snippet(dtype)
    ref.set_weights(model.get_weights())
    return ref


def mse(out, y):
    return keras.ops.mean(keras.ops.square(keras.ops.cast(out, "float32") - y))


def weights(model):
    return [np.asarray(keras.ops.convert_to_numpy(w)) for w in model.weights]


@pytest.mark.parametrize("policy,keras_name", [("mixed_bf16", "mixed_bfloat16"), ("mixed_fp16", "mixed_float16")])
def test_the_snippet_trains_with_keras_own_dtypes_and_remove_restores(policy, keras_name):
    m = snippet()
    before = weights(m)
    amp = unimp.apply(policy, m, keras.optimizers.Adam())
    ref = twin(m, keras_name)
    for mine, theirs in zip(m.layers, ref.layers, strict=True):
        assert (mine.dtype_policy.compute_dtype, mine.dtype_policy.variable_dtype) == \
            (theirs.dtype_policy.compute_dtype, theirs.dtype_policy.variable_dtype) == (keras_name[6:], "float32")
    out, expected = (np.asarray(keras.ops.convert_to_numpy(f(X[:4]))) for f in (m, ref))
    assert out.dtype == expected.dtype and np.array_equal(out, expected)  # the same kernels, bit for bit
    m.compile(optimizer=amp.optimizer, loss="mse")
    history = m.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    st = amp.loss_scale_state()
    assert st.steps == 8 and st.skipped <= (8 if policy == "mixed_fp16" else 0)
    state = amp.state_dict()
    json.dumps(state)  # plain numbers: a checkpoint written here loads under any Keras backend
    trained = weights(m)
    amp.remove()
    assert all(layer.dtype_policy.name == "float32" for layer in m.layers)
    assert [w.dtype for w in weights(m)] == [w.dtype for w in before]
    assert all(np.array_equal(a, b) for a, b in zip(weights(m), trained, strict=True))  # trained values kept
    assert any(not np.array_equal(a, b) for a, b in zip(before, trained, strict=True))


def _keras_reference(model, initial, interval):
    ref = twin(model, "mixed_float16")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=initial,
                                              dynamic_growth_steps=interval)
    return KerasOwn(ref, lso)


class KerasOwn:
    """Keras' own mixed precision, driven by the same custom step as an Amp."""

    _binding = None

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.scale_loss, self.apply_gradients = optimizer.scale_loss, optimizer.apply_gradients


@pytest.mark.parametrize("native", [False, None])
def test_mixed_fp16_skips_and_scales_as_keras_loss_scale_optimizer_in_each_backends_custom_step(native):
    """unimp's wrapper (native=False) and Keras' own rule (native=None on keras_mixed_float16) against Keras'
    LossScaleOptimizer over a Keras mixed_float16 twin: the same custom step (GradientTape / jax.grad +
    stateless_apply / backward), planted inf steps, bit-identical weights and the same scale after each step."""
    policy = unimp.load({"extends": "keras_mixed_float16", "loss_scale": {"initial": 1024.0, "growth_interval": 3}})
    if keras.backend.backend() == "torch":  # Keras' float32 multiply keeps subnormals on torch (IEEE)
        policy = policy.replace(loss_scale={"subnormal": "keep"})
    m = snippet()
    opt = keras.optimizers.SGD(0.05)
    ref = _keras_reference(m, 1024.0, 3)
    amp = unimp.apply(policy, m, opt, **({} if native is None else {"native_loss_scale": native}))
    assert type(amp.optimizer).__name__ == ("AmpOptimizer" if native is False else "KerasAmpOptimizer")
    plan = [False, False, True, False, False, False, True, True, False, False, False, False]  # True: inf
    for i, poison in enumerate(plan):
        x, y = X[(i % 4) * 8:(i % 4) * 8 + 8], Y[(i % 4) * 8:(i % 4) * 8 + 8]
        before = weights(m)
        custom_step(amp, mse, x, y, poison)
        custom_step(ref, mse, x, y, poison)
        assert amp.scale == float(keras.ops.convert_to_numpy(ref.optimizer.dynamic_scale)), i
        assert all(np.array_equal(a, b) for a, b in zip(weights(m), weights(ref.model), strict=True)), i
        if poison:
            assert all(np.array_equal(a, b) for a, b in zip(weights(m), before, strict=True)), i
    st = amp.loss_scale_state()
    assert (st.steps, st.skipped) == (len(plan), sum(plan))
    assert amp.scale == 1024.0 * 2 ** 2 / 2 ** 3  # 3 backoffs, 2 growths (interval 3)
    amp.remove()


def test_pure_bf16_keeps_float32_masters_in_fit_and_in_the_custom_step():
    m = snippet()
    amp = unimp.apply("pure_bf16", m, keras.optimizers.SGD(0.1))
    assert {w.dtype for w in m.weights} == {"bfloat16"}
    m.compile(optimizer=amp.optimizer, loss="mse")
    m.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    custom_step(amp, mse, X[:8], Y[:8])
    pairs = amp.master_pairs()
    assert len(pairs) == 4
    for _, low, master in pairs:  # the low params are cast(master) after every step
        rounded = keras.ops.cast(keras.ops.cast(keras.ops.convert_to_tensor(master), "bfloat16"), "float32")
        assert np.array_equal(low, np.asarray(keras.ops.convert_to_numpy(rounded)))
    masters = [np.asarray(master) for _, _, master in pairs]
    amp.remove()
    assert {w.dtype for w in m.weights} == {"float32"}
    assert all(np.array_equal(a, b) for a, b in zip(weights(m), masters, strict=True))


def test_a_state_dict_is_plain_and_loads_back():
    m = snippet()
    amp = unimp.apply({"extends": "mixed_fp16", "loss_scale": {"initial": 256.0, "growth_interval": 2}}, m,
                      keras.optimizers.SGD(0.1))
    for poison in (False, True, False):
        custom_step(amp, mse, X[:8], Y[:8], poison)
    state = json.loads(json.dumps(amp.state_dict()))
    amp.remove()
    m2 = snippet()
    amp2 = unimp.apply({"extends": "mixed_fp16", "loss_scale": {"initial": 256.0, "growth_interval": 2}}, m2,
                       keras.optimizers.SGD(0.1))
    amp2.load_state_dict(state)
    assert amp2.loss_scale_state() == amp.loss_scale_state() if not amp._removed else True
    assert (amp2.scale, amp2.skipped_steps) == (state["scale"], 1)
    amp2.remove()


def test_keras_float8_trains_or_is_refused_where_keras_cannot():
    m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="fc1"), keras.layers.Dense(16, name="fc2")])
    amp = unimp.apply("keras_float8", m, keras.optimizers.SGD(0.01))
    assert m.get_layer("fc1").quantization_mode == "float8"
    x, y = RNG.randn(8, 16).astype("float32"), RNG.randn(8, 16).astype("float32")
    m.compile(optimizer=amp.optimizer, loss="mse")
    m.fit(x, y, epochs=1, verbose=0)
    state = amp.state_dict()["fp8"]
    assert any(v != 0.0 for v in state["fc1.input_amax_history"])  # the amax history recorded real steps
    assert amp.report(x).row("fc1").fp8 == "delayed"
    amp.remove()
    assert m.get_layer("fc1").quantization_mode is None and len(m.get_layer("fc1").weights) == 2


def test_a_keras_backend_that_cannot_train_is_a_clear_error():
    """A real Keras 3 on its numpy backend (it ships with Keras; inference only), in a fresh process. Keras'
    numpy backend imports jax and scipy (keras/src/backend/numpy/math.py): the keras-jax env runs this part."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("jax") is None or importlib.util.find_spec("scipy") is None:
        pytest.skip("Keras' numpy backend imports jax and scipy, not installed in this env (keras-jax runs it)")

    code = ("import keras, unimp\n"
            "from unimp.backend import registry\n"
            "if 'keras' not in registry.backends():  # sources on PYTHONPATH, no entry point installed\n"
            "    from unimp_keras import KerasBackend; registry.register_backend(KerasBackend)\n"
            "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])\n"
            "try:\n"
            "    unimp.apply('mixed_bf16', m, keras.optimizers.SGD(0.1))\n"
            "except unimp.UnsupportedError as e:\n"
            "    print('UnsupportedError:', e)\n")
    env = {**os.environ, "KERAS_BACKEND": "numpy", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "UnsupportedError:" in out.stdout and "KERAS_BACKEND=tensorflow, jax or torch" in out.stdout, \
        out.stdout + out.stderr[-2000:]
    from unimp_keras.plan import check_keras_backend

    # Keras 2 (tf_keras) is not installable next to Keras 3 here: its version string is what the check reads
    old = types.SimpleNamespace(__version__="2.15.0", backend=types.SimpleNamespace(backend=lambda: "tensorflow"))
    with pytest.raises(unimp.UnsupportedError, match="pip install 'keras>=3'"):
        check_keras_backend(old)
