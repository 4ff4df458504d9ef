"""keras_hub GPT-2 / BERT (backbone + task head) and keras.applications MobileNetV2 under every preset, on the
Keras backend ``KERAS_BACKEND`` names (the keras-tensorflow, keras-jax and keras-torch tox envs each run this file;
cells go under ``keras-<backend>``)."""

import functools
import os
import re

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import keras_hub
import numpy as np
import pytest
from keras_env import GRAPH_OPS, walk
from tolerance import reference_tolerance

import unimp
from unimp_keras.testing import built_under, output_dtypes

STEPS = 10
RNG = np.random.default_rng(0)
TOKENS = {"token_ids": RNG.integers(0, 64, (4, 12)).astype("int32"), "padding_mask": np.ones((4, 12), bool)}
# preset -> Keras' own policy written by hand. fp32 must be bit-identical over the whole run. The
# low-precision presets differ from Keras' own by design (norms in float32 with a float32 output),
# and a 10-step trajectory amplifies any rounding difference chaotically (BatchNorm over 8 samples:
# measured 0.028 on an AVX512 EPYC, 0.116 on an AVX2-only one), so each step's loss is compared with
# Keras' own at the same weights (tests_models/tolerance.py).
NATIVE = {"fp32": "float32", "mixed_bf16": "mixed_bfloat16", "pure_bf16": "mixed_bfloat16",
          "mixed_fp16": "mixed_float16", "fp16_master": "mixed_float16", "keras_mixed_float16": "mixed_float16"}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
FRAMEWORK = f"keras-{keras.backend.backend()}"  # one compatibility column per Keras backend


class ReferenceLoss(keras.callbacks.Callback):
    """Keras' own policy's loss at the weights each step starts from (same batch, before the update)."""

    def __init__(self, native, x, y):
        super().__init__()
        self.native, self.x, self.y, self.losses = native, x, y, []

    def on_train_batch_begin(self, batch, logs=None):
        # the values the applied model computes with (low copies under pure_bf16), as float32 variables
        self.native.set_weights([keras.ops.convert_to_numpy(keras.ops.cast(w, "float32")) for w in self.model.weights])
        self.losses.append(float(LOSS(self.y, self.native(self.x, training=True))))


def gpt2():
    bb = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=16, dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=bb, preprocessor=None)


def bert():
    bb = keras_hub.models.BertBackbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=16, dropout=0.0)
    return keras_hub.models.BertTextClassifier(backbone=bb, num_classes=3, preprocessor=None, dropout=0.0)


def mobilenet():
    return keras.applications.MobileNetV2(input_shape=(48, 48, 3), alpha=0.35, weights=None, classes=4)


DATA = {
    "gpt2_causal_lm": (gpt2, TOKENS, RNG.integers(0, 64, (4, 12))),
    "bert_text_classifier": (bert, {**TOKENS, "segment_ids": np.zeros((4, 12), "int32")}, RNG.integers(0, 3, (4,))),
    "mobilenet_v2": (mobilenet, RNG.normal(size=(8, 48, 48, 3)).astype("float32"), RNG.integers(0, 4, (8,))),
}


def declared_on_jax_cpu(e):
    """The keras Plan's located refusal of float16 attention on JAX's CPU (XLA has no F16 x F16 -> F32 dot; a
    jitted step cannot compile it, Keras' own mixed_float16 included): ``unimp_keras.plan.device_fixed``."""
    return keras.backend.backend() == "jax" and "F16_F16_F32" in str(e) and "KERAS_BACKEND=jax" in str(e)


def numpy(x):
    """A backend tensor (TensorFlow, JAX or torch) as numpy."""
    return keras.ops.convert_to_numpy(x)


def build(name, policy="float32"):
    factory, x, _ = DATA[name]
    return built_under(policy, factory, x)


def fit(model, optimizer, name, callbacks=()):
    _, x, y = DATA[name]
    # 10 eager steps cost less than tracing a train function (measured: MobileNetV2 cell 27 s vs 37 s)
    model.compile(optimizer=optimizer, loss=LOSS, run_eagerly=True)
    # keras.Model.fit: keras_hub's PipelineModel.fit batches numpy inputs with grain or tf.data, neither of which
    # the JAX / torch envs have; without a preprocessor it runs this same fit after batching
    return keras.Model.fit(model, x, y, batch_size=len(y), epochs=STEPS, verbose=0, shuffle=False,
                           callbacks=list(callbacks)).history["loss"]


@functools.cache
def native_losses(name, policy, initial_scale):
    """Keras' own AMP written by hand (one run per model, Keras policy and initial loss scale)."""
    native = build(name, policy)
    native.set_weights(build(name).get_weights())  # the initial weights every cell starts from
    opt = keras.optimizers.Adam(1e-3)
    if policy == "mixed_float16":
        opt = keras.optimizers.LossScaleOptimizer(opt, initial_scale=initial_scale)
    return fit(native, opt, name)


def observed_outputs(model, units, x):
    """Output dtype of each unit layer, recorded by wrapping its call here (not by unimp)."""
    paths = {id(u.layer): u.path for u in units if not u.container}
    seen = {}
    for layer, dtype in output_dtypes(model, [u.layer for u in units if not u.container], x)[0]:
        seen.setdefault(paths[id(layer)], dtype)
    return seen


@pytest.mark.parametrize("preset", list(NATIVE))
@pytest.mark.parametrize("name", list(DATA))
def test_keras_model(name, preset, cell, tmp_path):
    c = cell(FRAMEWORK, name, preset)
    _, x, _ = DATA[name]
    model = build(name)
    weights = [w.numpy() for w in model.weights]
    before = numpy(model(x, training=False) if name == "mobilenet_v2" else model(x))

    # remove() without training: every weight, dtype policy and output bit for bit
    try:
        amp = unimp.apply(preset, model)
    except unimp.UnsupportedError as e:
        if not declared_on_jax_cpu(e):
            raise
        c.na(f"the Plan refuses it on JAX's CPU (jitted fit cannot compile float16 attention; Keras' own "
             f"mixed_float16 fails the same way): {str(e).splitlines()[1].strip()[:160]}")
    amp.remove()
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.weights))
    assert {layer.dtype_policy.name for layer in model._flatten_layers()} == {"float32"}
    assert np.array_equal(before, numpy(model(x, training=False) if name == "mobilenet_v2" else model(x)))
    c.check("remove", "untouched model bit for bit (weights, dtype policies, outputs)")

    # 10 steps vs Keras' own AMP written by hand (same initial weights)
    native_policy = NATIVE[preset]
    amp = unimp.apply(preset, model, keras.optimizers.Adam(1e-3))
    if native_policy == "float32":
        losses = fit(model, amp.optimizer, name)
        want = native_losses(name, native_policy, 2.0 ** 15)
        assert losses == want, (losses, want)
        c.check("loss", f"{STEPS} steps, bit-identical to Keras `{native_policy}`")
    else:
        _, x, y = DATA[name]
        reference = ReferenceLoss(build(name, native_policy), x, y)
        losses = fit(model, amp.optimizer, name, [reference])
        assert np.isfinite(losses).all() and losses[-1] < losses[0], losses  # it trains
        rel = float(np.max(np.abs(np.subtract(losses, reference.losses)) / np.abs(reference.losses)))
        tol = reference_tolerance(unimp.load(preset).compute_dtype, len(amp._binding.units))
        assert rel <= tol, (losses, reference.losses)
        c.check("loss", f"{STEPS} steps; each step's loss vs Keras `{native_policy}` at the same weights: max rel "
                        f"diff {rel:.1e} (tolerance u*sqrt(layers) = {tol:.1e})")

    # report rows vs output dtypes seen by our own hooks; lower-list layers compute in the preset's dtype
    policy = unimp.load(preset)
    report = amp.report(x)
    seen = observed_outputs(model, amp._binding.units, x)
    rows = [r for r in report.rows if r.path in seen]
    assert rows and all(r.output_dtype == seen[r.path] for r in rows)
    lowered = [r for r in rows if r.kind in ("linear", "conv", "attention") and not policy.overrides]
    assert lowered and all(r.compute_dtype == policy.compute_dtype for r in lowered), lowered
    c.check("report", f"{len(rows)} rows = observed output dtypes; linear/conv/attention in {policy.compute_dtype}")

    # .keras saved while applied: loads without unimp, float32, equal to the removed (trained) model
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # the default call: compiled with Keras' own optimizer classes
    assert type(loaded.optimizer).__module__.startswith("keras.")
    amp.remove()
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(model.weights, loaded.weights))
    assert {w.dtype for w in loaded.weights} <= {"float32", "int32", "int64"}
    c.check("save/load", "`.keras` saved while applied loads with keras.models.load_model (no unimp); "
                         "float32 weights = the model after remove()")


# ---------------------------------------------------------------- composite attention layers (issue 27, item 17)
def gemma():
    return keras_hub.models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                                          hidden_dim=32, intermediate_dim=64, head_dim=16)


BACKBONES = {  # keras_hub attention: Gemma's is a composite layer (raw einsums), GPT-2's/BERT's subclass MHA
    "gemma": (gemma, TOKENS),
    "gpt2": (lambda: gpt2().backbone, TOKENS),
    "bert": (lambda: bert().backbone, {**TOKENS, "segment_ids": np.zeros((4, 12), "int32")}),
}
KERAS_OWN = {"mixed_bf16": "mixed_bfloat16", "mixed_fp16": "mixed_float16"}


def plain(path):
    """A layer/op path without Keras' uniquifying suffixes (``rotary_embedding_1_1`` -> ``rotary_embedding``)."""
    return re.sub(r"(_\d+)+(?=$|[/.])", "", path)


def _tensorflow_matmuls(model, x):
    """TF's traced forward graph: every matmul/conv op (TF's own op list: GRAPH_OPS) by op name, sorted."""
    import tensorflow as tf

    graph = tf.function(lambda: model(x, training=False)).get_concrete_function().graph
    kinds = GRAPH_OPS["matmul"] + GRAPH_OPS["conv"]
    return sorted((plain(op.name.split("/", 1)[1]), op.type, (op.get_attr("T").name,))
                  for op in graph.get_operations() if op.type in kinds)


def _jax_matmuls(model, x):
    """JAX's jaxpr of the forward: every dot_general / conv equation (nested jaxprs included) in order, with the
    name scope Keras gives it (``keras.name_scope`` is a ``jax.named_scope`` on this backend)."""
    import jax

    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                scope = str(eqn.source_info.name_stack).split("/", 1)[-1]
                found.append((plain(scope), eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars)))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        visit(sub.jaxpr)

    visit(jax.make_jaxpr(lambda: model(x, training=False))().jaxpr)
    return found


TORCH_MATMULS = ("mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution")


def _torch_matmuls(model, x):
    """torch's aten dispatch of the forward: every matmul / conv call in order with its tensor inputs' dtypes
    (aten has no layer names: ``""``)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in TORCH_MATMULS:
                tensors = [a for a in keras.tree.flatten(args) if isinstance(a, torch.Tensor)]
                found.append(("", name, tuple(str(t.dtype).removeprefix("torch.") for t in tensors)))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Record():
        model(x, training=False)
    return found


def matmul_dtypes(model, x):
    """(scope, op, operand dtypes) of every matmul-class op one forward runs, as the backend's own tracer records
    it (not unimp): a TF graph, a jaxpr, torch's aten dispatch."""
    return {"tensorflow": _tensorflow_matmuls, "jax": _jax_matmuls, "torch": _torch_matmuls}[
        keras.backend.backend()](model, x)


@pytest.mark.parametrize("preset", list(KERAS_OWN))
@pytest.mark.parametrize("name", list(BACKBONES))
def test_attention_layers_follow_the_policy_as_keras_own_policy_does(name, preset):
    """Oracle: Keras' own mixed policy set by hand on the same keras_hub backbone (random init)."""
    factory, x = BACKBONES[name]
    keras.utils.set_random_seed(0)
    model = factory()
    model(x)
    keras.config.set_dtype_policy(KERAS_OWN[preset])
    try:
        native = factory()
    finally:
        keras.config.set_dtype_policy("float32")
    try:
        amp = unimp.apply(preset, model)
    except unimp.UnsupportedError as e:
        if not declared_on_jax_cpu(e):
            raise
        pytest.skip(f"declared by the Plan on JAX's CPU: {str(e).splitlines()[1].strip()[:160]}")
    ours, theirs = matmul_dtypes(model, x), matmul_dtypes(native, x)
    low = unimp.load(preset).compute_dtype
    assert ours == theirs, (ours, theirs)
    assert sum(low in dtypes for _, _, dtypes in ours) >= 4, ours  # the q/k/v/output projections at least
    if name == "gemma" and keras.backend.backend() != "torch":  # Gemma's two attention einsums, in its own scope
        raw = [dtypes for scope, _, dtypes in ours if re.search(r"(^|/)attention/[^/]+$", scope)]
        assert len(raw) == 2 and all(set(d) == {low} for d in raw), ours
    # per layer: what the policy lowers computes as Keras' own policy computes it, and every layer that
    # computes (the composite attention included) has a report row
    rows = {plain(r.path): r for r in amp.report(x).rows}
    native_layers = {plain(u.path): u.layer for u in walk(native)}
    lowered = [u for u in amp._binding.units if u.kind in unimp.load(preset).ops.lower]
    ran = set(observed_outputs(model, amp._binding.units, x)) | {u.path for u in amp._binding.units if u.container}
    assert lowered and {plain(p) for p in ran} <= set(rows), ran - set(rows)
    for u in lowered:
        assert rows[plain(u.path)].compute_dtype == low == native_layers[plain(u.path)].compute_dtype, u.path
    if name == "gemma":
        assert rows["decoder_block.attention"].kind == "attention"
    amp.remove()
