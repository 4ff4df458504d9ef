"""BatchNormalization under the mixed presets is Keras' own under ``mixed_<low>``: statistics and normalisation
in float32 (float32 gamma / beta / moving statistics), the output in the compute dtype, so the Add and ReLU
after it run low too (as Keras' own mixed policies, torch autocast and Paddle run them).

Expected values come from a Keras twin built under ``keras.config.set_dtype_policy`` (the real layer)."""

import keras
import numpy as np
import pytest

import unimp

X = np.random.default_rng(0).normal(size=(4, 8, 8, 8)).astype("float32")


def block(policy):
    old = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        x = keras.Input((8, 8, 8))
        y = keras.layers.Conv2D(8, 3, padding="same", name="conv")(x)
        y = keras.layers.BatchNormalization(name="bn")(y)
        y = keras.layers.Add(name="add")([y, keras.layers.Conv2D(8, 1, name="skip")(x)])
        return keras.Model(x, keras.layers.ReLU(name="relu")(y))
    finally:
        keras.config.set_dtype_policy(old)


def outputs(model):
    names = ("bn", "add", "relu")
    probe = keras.Model(model.input, [model.get_layer(n).output for n in names])
    return dict(zip(names, (keras.ops.convert_to_numpy(t) for t in probe(X, training=True)), strict=True))


@pytest.mark.parametrize(("preset", "keras_name"), [("mixed_fp16", "mixed_float16"), ("mixed_bf16", "mixed_bfloat16")])
def test_batchnorm_returns_the_compute_dtype_over_float32_statistics_as_keras(preset, keras_name):
    model, twin = block("float32"), block(keras_name)
    twin.set_weights(model.get_weights())
    amp = unimp.apply(preset, model)
    mine, theirs = outputs(model), outputs(twin)
    low = keras_name[len("mixed_"):]
    assert {n: str(a.dtype) for n, a in mine.items()} == {n: str(a.dtype) for n, a in theirs.items()} == \
        dict.fromkeys(("bn", "add", "relu"), low)
    assert all(np.array_equal(mine[n], theirs[n]) for n in mine)  # the same float32 statistics, bit for bit
    bn, twin_bn = model.get_layer("bn"), twin.get_layer("bn")
    assert [v.dtype for v in bn.weights] == [v.dtype for v in twin_bn.weights] == ["float32"] * 4
    assert all(np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))  # moving stats
               for a, b in zip(bn.weights, twin_bn.weights, strict=True))
    amp.remove()
    assert model.get_layer("bn").dtype_policy.name == "float32"
