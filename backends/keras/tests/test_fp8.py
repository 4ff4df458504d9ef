"""FP8 on Keras 3: Keras' float8 Dense training on the layers the Plan chooses, on every Keras backend's CPU
(the eager float8 refusal is TensorFlow's: its float8 gradient does not run eagerly).

Tolerance: after 10 full-batch Adam steps the FP8 loss is within 10% of the bf16 run's.
"""

import keras
import numpy as np
import pytest

import unimp
from unimp.conformance import run_case
from unimp.conformance.fp8 import fp8_cases
from unimp.errors import UnsupportedError
from unimp_keras.fp8 import NAMES

pytestmark = pytest.mark.filterwarnings("ignore::unimp.UnimpWarning")  # bf16 emulated on this CPU, etc.

X = np.random.RandomState(0).rand(64, 32).astype("float32")
Y = np.random.RandomState(1).rand(64, 10).astype("float32")
# FP8 (not derived, kept as is; issue 27): e4m3 keeps 3 mantissa bits (u = 2**-4), so u*sqrt(n) would
# exceed 6% a layer; 10% is a stated bound of the final loss against bf16's
EPOCHS, TOL = 10, 0.10
FP8 = unimp.load("fp8_delayed")  # amax history 16


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu", name="fc1"),
                             keras.layers.Dense(16, activation="relu", name="fc2"),
                             keras.layers.Dense(10, name="head")])  # 10: not a multiple of 16


def fit(policy, epochs=EPOCHS):
    model = mlp()
    amp = unimp.apply(policy, model, keras.optimizers.Adam(1e-2))
    model.compile(optimizer=amp.optimizer, loss="mse")
    losses = model.fit(X, Y, epochs=epochs, batch_size=64, verbose=0).history["loss"] if epochs else []
    return amp, model, losses


def test_keras_float8_fit_trains_close_to_bf16():
    ref_amp, _, ref = fit("mixed_bf16")
    ref_amp.remove()
    amp, model, losses = fit(FP8)
    for name in ("fc1", "fc2"):
        layer = model.get_layer(name)
        assert layer.quantization_mode == "float8"
        assert layer.inputs_amax_history.shape == (FP8.fp8.amax_history,)
    assert model.get_layer("head").quantization_mode is None
    rows = {r.path: r for r in amp.report().rows}
    assert {p: rows[p].fp8 for p in ("fc1", "fc2", "head")} == {"fc1": "delayed", "fc2": "delayed", "head": None}
    assert rows["head"].compute_dtype == amp.plan.compute_dtype
    assert any("head" in n and "dims_multiple" in n for n in amp.report().notes)
    assert losses[-1] < 0.5 * losses[0]
    assert abs(losses[-1] - ref[-1]) <= TOL * ref[-1] and losses != ref
    assert model.get_layer("fc1").inputs_amax_history.numpy()[0] > 0  # the optimizer overwrote the state
    amp.remove()


def test_loss_scaling_leaves_the_float8_state_unscaled():
    """The optimizer wrapper unscales gradients, never the scaling variables' new values."""
    plain, m1, _ = fit(FP8, epochs=1)
    scaled, m2, _ = fit(FP8.replace(loss_scale={"mode": "dynamic"}), epochs=1)
    assert scaled.scale == scaled.plan.loss_scale.initial and scaled.skipped_steps == 0  # no step overflowed
    for name in ("inputs_scale", "kernel_scale", "inputs_amax_history"):
        a, b = getattr(m1.get_layer("fc1"), name).numpy(), getattr(m2.get_layer("fc1"), name).numpy()
        assert np.array_equal(a, b), name
    plain.remove()
    scaled.remove()


def test_state_dict_round_trips_the_float8_state_exactly():
    amp, model, _ = fit(FP8, epochs=3)
    sd = amp.state_dict()
    assert {f"fc1.{n}" for n in NAMES.values()} <= set(sd["fp8"]) and not any(k.startswith("head.") for k in sd["fp8"])
    trained = {k: getattr(model.get_layer("fc2"), k).numpy() for k in NAMES}
    amp.remove()
    fresh, model2, _ = fit(FP8, epochs=0)
    fresh.load_state_dict(sd)
    for k, v in trained.items():
        assert np.array_equal(getattr(model2.get_layer("fc2"), k).numpy(), v), k
    assert fresh.state_dict() == sd
    with pytest.raises(unimp.StateError, match="fp8.fc1.input_amax_history"):
        fresh.load_state_dict({**sd, "fp8": {**sd["fp8"], "fc1.input_amax_history": [1.0]}})
    fresh.remove()


def test_remove_restores_the_layer_exactly():
    model = mlp()
    before = [(w.path, w.numpy()) for w in model.weights]
    config = model.get_config()
    amp = unimp.apply(FP8, model, keras.optimizers.Adam(1e-2))
    assert len(model.get_layer("fc1").weights) == 2 + len(NAMES)
    amp.remove()
    after = [(w.path, w.numpy()) for w in model.weights]
    assert [p for p, _ in after] == [p for p, _ in before]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(before, after, strict=True))
    assert model.get_config() == config
    assert all(layer.quantization_mode is None for layer in model.layers)
    out = model(X[:2])
    assert keras.backend.standardize_dtype(out.dtype) == "float32"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_recipes_keras_lacks_are_refused_naming_its_recipe(recipe):
    policy = FP8.replace(fp8={"recipe": recipe})
    with pytest.raises(UnsupportedError, match=f"fp8.recipe = '{recipe}'.*delayed"):
        unimp.apply(policy, mlp(), keras.optimizers.Adam(1e-2))
    model = mlp()
    amp = unimp.apply(policy.replace(on_unsupported="fallback"), model, keras.optimizers.Adam(1e-2))
    assert not amp.plan.fp8.active
    assert all(layer.quantization_mode is None for layer in model.layers)
    amp.remove()


def test_e4m3_gradients_are_refused():
    with pytest.raises(UnsupportedError, match="gradient_format"):
        unimp.apply(FP8.replace(fp8={"gradient_format": "e4m3"}), mlp(), keras.optimizers.Adam(1e-2))


@pytest.mark.parametrize("case", fp8_cases(), ids=str)
def test_fp8_conformance(case, kit):
    run_case(case, kit)


@pytest.mark.keras_backend("tensorflow")
def test_eager_gradient_tape_is_a_clear_error_and_tf_function_trains():
    import tensorflow as tf

    model = mlp()
    amp = unimp.apply(FP8, model, keras.optimizers.Adam(1e-2))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(X, training=True) - Y) ** 2)
        grads = tape.gradient(amp.scale_loss(loss), model.trainable_variables)
        amp.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    with pytest.raises(UnsupportedError, match="'fc1'.*tf.function"):
        step()
    compiled = tf.function(step)
    losses = [float(compiled()) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert model.get_layer("fc1").inputs_amax_history.numpy()[0] > 0
    amp.remove()
    assert "quantized_call" not in vars(model.get_layer("fc1"))
