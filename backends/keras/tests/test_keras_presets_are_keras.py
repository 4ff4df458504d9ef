"""The presets named after Keras are Keras, bit for bit, on the Keras backend this run uses.

``keras_mixed_float16`` against what a Keras user writes: ``keras.config.set_dtype_policy("mixed_float16")``
before building, ``keras.optimizers.LossScaleOptimizer`` around the optimizer, ``compile`` + ``fit``. On
keras_hub GPT-2, BERT and Gemma (tiny configs, random init) and keras.applications MobileNetV2
(``weights=None``, its first blocks): every layer's output dtype, the model's output and 20 ``fit`` steps
(losses, weights, loss scale), eagerly (``run_eagerly=True``), with Keras' default compile
(``jit_compile="auto"``: XLA-jitted on JAX, a ``tf.function`` on TensorFlow's CPU, no ``torch.compile`` on
torch) and, on TensorFlow, ``jit_compile=True`` (Gemma: XLA's compile of each model costs ~10-20 s there).

Where it is not compared, it says why: GPT-2 / BERT on JAX's CPU (Keras' own float16 attention does not compile
in XLA there; the Plan refuses it: test_blocks_and_saving.py); keras_hub Gemma built in float32 on TensorFlow
bakes ``x * cast(sqrt(d), x.dtype)`` into its graph as float32 at build time, so there the unimp model is built
in ``unimp.scope("keras_mixed_float16")`` (Keras' global policy set as a Keras user sets it).
"""

import keras
import numpy as np
import pytest

import unimp
from unimp_keras.testing import built_under, output_dtypes

keras_hub = pytest.importorskip("keras_hub")

PRESETS = {"keras_mixed_float16": "mixed_float16"}  # every preset named after Keras: Keras' own policy
STEPS = 20
BACKEND = keras.backend.backend()
RNG = np.random.default_rng(0)
TOKENS = {"token_ids": RNG.integers(0, 64, (2, 8)).astype("int32"), "padding_mask": np.ones((2, 8), "int32")}
LOSS = keras.losses.MeanSquaredError()  # the backbones' token states / MobileNetV2's features against fixed targets


def gpt2():
    return keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                         intermediate_dim=32, max_sequence_length=8, dropout=0.0)


def bert():
    bb = keras_hub.models.BertBackbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                       intermediate_dim=32, max_sequence_length=8, dropout=0.0)
    return keras.Model(bb.input, bb.output["sequence_output"])  # the backbone's token states, trained with MSE


def gemma():
    return keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                                          hidden_dim=16, intermediate_dim=32, head_dim=8, dropout=0.0)


def mobilenet():
    """keras.applications MobileNetV2's stem and first inverted-residual blocks (through the first residual
    Add): its Conv2D / BatchNormalization / ReLU(6) / DepthwiseConv2D / ZeroPadding2D / Add layers as Keras
    builds them, a twelfth of its trace time (the whole model's compiled fit: ~90 s on TensorFlow's CPU)."""
    full = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, include_top=False)
    return keras.Model(full.input, full.get_layer("block_2_add").output)


MODELS = {
    "gpt2": (gpt2, TOKENS, RNG.normal(size=(2, 8, 16)).astype("float32")),
    "bert": (bert, {**TOKENS, "segment_ids": np.zeros((2, 8), "int32")}, RNG.normal(size=(2, 8, 16)).astype("float32")),
    "gemma": (gemma, TOKENS, RNG.normal(size=(2, 8, 16)).astype("float32")),
    "mobilenet_v2": (mobilenet, RNG.normal(size=(4, 32, 32, 3)).astype("float32"),
                     RNG.normal(size=(4, 8, 8, 8)).astype("float32")),
}


def build(name, policy):
    """The model as its user builds it under Keras' global ``policy`` (seeded: the same weights every time)."""
    factory, x, _ = MODELS[name]
    return built_under(policy, factory, x)


def unimp_model(name, preset):
    """The float32 model with the preset applied (TensorFlow Gemma: built in the preset's scope, see above)."""
    if name == "gemma" and BACKEND == "tensorflow":
        factory, x, _ = MODELS[name]
        with unimp.scope(preset) as s:
            model = built_under(keras.config.dtype_policy(), factory, x)  # the scope's global policy
        return model, s.apply
    return build(name, "float32"), lambda model, opt: unimp.apply(preset, model, opt)


def layer_dtypes(model, x):
    """Each layer's class and output dtype in one call (recorded outside unimp), and the outputs."""
    seen, out = output_dtypes(model, model._flatten_layers(include_self=False), x)
    return [(type(la).__name__, d) for la, d in seen], [keras.ops.convert_to_numpy(t) for t in keras.tree.flatten(out)]


def train(model, optimizer, name, mode):
    _, x, y = MODELS[name]
    model.compile(optimizer=optimizer, loss=LOSS,
                  run_eagerly=mode == "eager", jit_compile=True if mode == "xla" else "auto")
    return keras.Model.fit(model, x, y, batch_size=len(y), epochs=STEPS, verbose=0, shuffle=False).history["loss"]


def skip_reason(name, mode):
    if name == "mobilenet_v2" and mode == "eager":
        return "MobileNetV2: compared with the default compile (its dtypes and output there; eagerly ~30 s more)"
    if mode == "xla" and BACKEND != "tensorflow":
        return f"{BACKEND}: the default compile is the jitted one (JAX: jit; torch: Keras runs no torch.compile)"
    if mode == "xla" and name != "gemma":
        return "jit_compile=True on TensorFlow: Gemma's (XLA's compile costs ~10-20 s per model on this CPU)"
    if BACKEND == "jax" and name in ("gpt2", "bert"):
        return ("JAX's CPU: Keras' own mixed_float16 attention (dot_product_attention) does not compile in XLA, "
                "and the Plan refuses float16 there with the declared error (test_blocks_and_saving.py)")
    return None


def same(a, b):
    return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("mode", ["eager", "compiled", "xla"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_keras_named_preset_is_keras_bit_for_bit(preset, name, mode):
    if (why := skip_reason(name, mode)) is not None:
        pytest.skip(why)
    _, x, _ = MODELS[name]
    native = build(name, PRESETS[preset])
    model, apply = unimp_model(name, preset)
    model.set_weights(native.get_weights())
    amp = apply(model, keras.optimizers.Adam(1e-3))
    if mode == "eager" or (mode == "compiled" and name == "mobilenet_v2"):  # dtypes and outputs: once per model
        mine, out = layer_dtypes(model, x)
        theirs, expected = layer_dtypes(native, x)
        assert mine == theirs
        assert all(same(a, b) for a, b in zip(out, expected, strict=True))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    losses, expected_losses = train(model, amp.optimizer, name, mode), train(native, lso, name, mode)
    assert losses == expected_losses
    assert amp.scale == float(keras.ops.convert_to_numpy(lso.dynamic_scale))
    assert all(same(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
               for a, b in zip(model.weights, native.weights, strict=True))
    amp.remove()


@pytest.mark.parametrize("preset", ["mixed_fp16", "fp16_master"])
def test_the_generic_fp16_presets_start_where_keras_loss_scale_optimizer_starts(preset):
    """``loss_scale.initial = "auto"`` (their default): Keras' own ``LossScaleOptimizer`` is the oracle."""
    model = build("mobilenet_v2", "float32")
    amp = unimp.apply(preset, model, keras.optimizers.Adam(1e-3))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    assert amp.scale == amp.plan.loss_scale.initial == float(lso.initial_scale)
    amp.remove()


def test_mixed_fp16_on_a_batchnorm_net_is_keras_mixed_float16():
    """``mixed_fp16`` differs from Keras' ``mixed_float16`` by design where it keeps LayerNorm / softmax in
    float32; a conv net with BatchNormalization has neither, so there it is Keras' own policy: the layer dtypes,
    20 compiled ``fit`` steps, the weights and the loss scale (which starts at Keras' 2^15), bit for bit."""
    _, x, _ = MODELS["mobilenet_v2"]
    native = build("mobilenet_v2", "mixed_float16")
    model = build("mobilenet_v2", "float32")
    model.set_weights(native.get_weights())
    amp = unimp.apply("mixed_fp16", model, keras.optimizers.Adam(1e-3))
    assert layer_dtypes(model, x)[0] == layer_dtypes(native, x)[0]
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    assert train(model, amp.optimizer, "mobilenet_v2", "compiled") == train(native, lso, "mobilenet_v2", "compiled")
    assert amp.scale == float(keras.ops.convert_to_numpy(lso.dynamic_scale))
    assert all(same(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
               for a, b in zip(model.weights, native.weights, strict=True))
    amp.remove()


def test_exporting_mixed_fp16_to_keras_writes_keras_own_starting_scale():
    from unimp import migrate

    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    assert migrate.export_to("keras", "mixed_fp16").config["LossScaleOptimizer"]["initial_scale"] == lso.initial_scale


def test_unimp_diff_shows_where_auto_and_a_pinned_2_16_run_apart(tmp_path, capsys):
    from unimp.cli import main

    # on_unsupported = "fallback": compiled without a model, JAX's CPU refuses float16 attention
    auto, pinned = tmp_path / "auto.toml", tmp_path / "pinned.toml"
    auto.write_text('name = "auto"\nextends = "mixed_fp16"\non_unsupported = "fallback"\n')
    pinned.write_text('name = "pinned"\nextends = "auto.toml"\n[loss_scale]\ninitial = 65536.0\n')
    assert main(["diff", str(auto), str(pinned), "--backend", "keras"]) == 0
    out = capsys.readouterr().out
    assert "backend keras: 1 differences in what runs" in out
    assert "dynamic from 32768 (" in out and "dynamic from 65536 (" in out
