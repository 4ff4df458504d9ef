"""Several optimizers in one Keras process, side by side with Keras' own mixed precision.

keras.io's DCGAN (examples/generative/dcgan_overriding_train_step): a ``keras.Model`` subclass
with a discriminator, a generator and ``d_optimizer`` / ``g_optimizer``; under Keras'
``mixed_float16`` each optimizer is a ``LossScaleOptimizer`` of its own (its own scale). With unimp
each sub-model gets its own Amp (its optimizer wrapped with its own scale, as Keras does), and the
example's ``train_step`` runs unchanged on the wrappers (``scale_loss``, ``apply_gradients``) on
TensorFlow and torch; on JAX (whose trainer calls a stateless ``train_step``) the same two steps run
jitted through ``stateless_call`` / ``stateless_apply``.
A list of optimizers for one Keras model is refused naming that pattern.
"""

import keras
import numpy as np
import pytest

import unimp
from unimp.errors import UnsupportedError

LATENT, SIDE = 8, 16


def discriminator(dtype=None):
    return keras.Sequential([
        keras.Input((SIDE, SIDE, 3)),
        keras.layers.Conv2D(8, 4, strides=2, padding="same", dtype=dtype),
        keras.layers.LeakyReLU(0.2, dtype=dtype),
        keras.layers.Conv2D(16, 4, strides=2, padding="same", dtype=dtype),
        keras.layers.LeakyReLU(0.2, dtype=dtype),
        keras.layers.GlobalMaxPooling2D(dtype=dtype),
        keras.layers.Dense(1, activation="sigmoid", dtype=dtype)], name="discriminator")


def generator(dtype=None):
    return keras.Sequential([
        keras.Input((LATENT,)),
        keras.layers.Dense(4 * 4 * 16, dtype=dtype),
        keras.layers.Reshape((4, 4, 16), dtype=dtype),
        keras.layers.Conv2DTranspose(16, 4, strides=2, padding="same", dtype=dtype),
        keras.layers.LeakyReLU(0.2, dtype=dtype),
        keras.layers.Conv2DTranspose(8, 4, strides=2, padding="same", dtype=dtype),
        keras.layers.LeakyReLU(0.2, dtype=dtype),
        keras.layers.Conv2D(3, 5, padding="same", activation="sigmoid", dtype=dtype)], name="generator")


class GAN(keras.Model):
    """keras.io's DCGAN ``GAN`` model; the latent vectors come with the batch (the example draws them inside the
    step from a seed generator), its label noise left out, so that two runs see the same numbers."""

    def __init__(self, disc, gen):
        super().__init__()
        self.discriminator, self.generator = disc, gen
        self.built = True  # both sub-models are (Keras' torch trainer would otherwise call the GAN to build it)

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile(jit_compile=False)
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, data):
        real, z_d, z_g = data[0] if len(data) == 1 else data
        batch = keras.ops.shape(real)[0]
        combined = keras.ops.concatenate([self.generator(z_d), real], axis=0)
        labels = keras.ops.concatenate([keras.ops.ones((batch, 1)), keras.ops.zeros((batch, 1))], axis=0)
        d_vars, g_vars = self.discriminator.trainable_weights, self.generator.trainable_weights
        d_loss = self._step(self.d_optimizer, d_vars, lambda: self.loss_fn(labels, self.discriminator(combined)))
        g_loss = self._step(self.g_optimizer, g_vars, lambda: self.loss_fn(
            keras.ops.zeros((batch, 1)), self.discriminator(self.generator(z_g))))
        return {"d_loss": d_loss, "g_loss": g_loss}

    def _step(self, optimizer, variables, loss_of):
        """The example's ``GradientTape`` step on TensorFlow (``backward()`` on Keras' torch backend), with each
        optimizer's ``scale_loss`` as Keras' mixed-precision guide adds it."""
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = loss_of()
                scaled = optimizer.scale_loss(loss)
            optimizer.apply_gradients(zip(tape.gradient(scaled, variables), variables))
            return loss
        self.zero_grad()
        loss = loss_of()
        optimizer.scale_loss(loss).backward()
        optimizer.apply_gradients([(v.value.grad, v) for v in variables])
        return loss


def jax_fit(gan, data, b=4):
    """The same two steps on Keras' JAX backend, the way JAX differentiates (as unimp_keras.steps does for one
    optimizer): ``stateless_call`` + ``jax.grad`` of each optimizer's scaled loss (``scale_loss`` in a
    ``StatelessScope`` over its variables) + ``stateless_apply``, jitted; the new values assigned back."""
    import jax

    disc, gen, d_opt, g_opt, loss_fn = gan.discriminator, gan.generator, gan.d_optimizer, gan.g_optimizer, gan.loss_fn
    for opt, model in ((d_opt, disc), (g_opt, gen)):
        if not opt.built:
            opt.build(model.trainable_variables)

    def scaled(opt, ov, loss):
        with keras.StatelessScope(state_mapping=list(zip(opt.variables, ov, strict=True))):
            return opt.scale_loss(loss)

    def step(d_tv, g_tv, d_ov, g_ov, real, z_d, z_g):
        n = real.shape[0]
        labels = keras.ops.concatenate([keras.ops.ones((n, 1)), keras.ops.zeros((n, 1))], axis=0)

        def d_loss(d_tv):
            fake, _ = gen.stateless_call(g_tv, [], z_d)
            pred, _ = disc.stateless_call(d_tv, [], keras.ops.concatenate([fake, real], axis=0))
            return scaled(d_opt, d_ov, loss_fn(labels, pred))

        d_tv, d_ov = d_opt.stateless_apply(d_ov, jax.grad(d_loss)(d_tv), d_tv)

        def g_loss(g_tv):
            pred, _ = disc.stateless_call(d_tv, [], gen.stateless_call(g_tv, [], z_g)[0])
            return scaled(g_opt, g_ov, loss_fn(keras.ops.zeros((n, 1)), pred))

        g_tv, g_ov = g_opt.stateless_apply(g_ov, jax.grad(g_loss)(g_tv), g_tv)
        return d_tv, g_tv, d_ov, g_ov

    jitted = jax.jit(step)
    groups = (disc.trainable_variables, gen.trainable_variables, d_opt.variables, g_opt.variables)
    for i in range(0, len(data[0]), b):
        new = jitted(*([v.value for v in g] for g in groups), *(a[i:i + b] for a in data))
        for group, values in zip(groups, new, strict=True):
            for var, value in zip(group, values, strict=True):
                var.assign(value)


def weights(*models):
    return [np.asarray(keras.ops.convert_to_numpy(w)) for m in models for w in m.weights]


def data(steps=4, b=4):
    g = np.random.default_rng(0)
    return (g.uniform(size=(steps * b, SIDE, SIDE, 3)).astype("float32"),
            g.normal(size=(steps * b, LATENT)).astype("float32"), g.normal(size=(steps * b, LATENT)).astype("float32"))


def adam():
    return keras.optimizers.Adam(2e-3, beta_1=0.5)


def test_keras_dcgan_two_optimizers_match_loss_scale_optimizers_bitwise(initial=2.0 ** 18):
    """keras.io's DCGAN train_step, two optimizers: unimp (each sub-model its Amp, keras_mixed_float16) equals
    Keras' mixed_float16 with one LossScaleOptimizer per optimizer, bit for bit: weights and both scales
    (TensorFlow and torch: the example's train_step under fit; JAX: the same steps, jitted, stateless)."""
    keras.utils.set_random_seed(0)
    disc, gen = discriminator(), generator()
    native_d, native_g = discriminator("mixed_float16"), generator("mixed_float16")
    native_d.set_weights(disc.get_weights())
    native_g.set_weights(gen.get_weights())
    policy = {"extends": "keras_mixed_float16", "loss_scale": {"initial": initial}}
    if keras.backend.backend() == "torch":  # Keras' float32 multiply keeps subnormals on torch (IEEE)
        policy["loss_scale"]["subnormal"] = "keep"
    if keras.backend.backend() == "jax":  # XLA multiplies the factors in float32 (Keras' own rule there)
        policy["loss_scale"]["factor_arithmetic"] = "float32"
    before = weights(disc)
    amp_d = unimp.apply(policy, disc, adam())
    amp_g = unimp.apply(policy, gen, adam())
    ours, native = GAN(disc, gen), GAN(native_d, native_g)
    ours.compile(amp_d.optimizer, amp_g.optimizer, keras.losses.BinaryCrossentropy())
    native.compile(*(keras.optimizers.LossScaleOptimizer(adam(), initial_scale=initial) for _ in range(2)),
                   keras.losses.BinaryCrossentropy())
    for gan in (ours, native):
        if keras.backend.backend() == "jax":  # Keras' JAX trainer calls a stateless train_step: the JAX way
            jax_fit(gan, data(6))
        else:
            gan.fit(data(6), batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(weights(disc, gen), weights(native_d, native_g), strict=True))
    scales = [float(keras.ops.convert_to_numpy(o.dynamic_scale)) for o in (native.d_optimizer, native.g_optimizer)]
    assert [amp_d.scale, amp_g.scale] == scales
    # the scale starts too high: steps overflow, skip and back off, then training goes on (weights moved)
    assert amp_d.skipped_steps > 0 and amp_d.skipped_steps < 6 and amp_d.scale < initial, amp_d.state_dict()
    assert any(not np.array_equal(a, b) for a, b in zip(weights(disc), before, strict=True))
    amp_g.remove(), amp_d.remove()


def test_keras_list_of_optimizers_refused_naming_one_amp_per_model():
    """``unimp.apply(policy, gan, [d_opt, g_opt])`` on Keras: refused before anything changes, naming the
    Keras pattern (one Amp per sub-model, each optimizer its own loss scale)."""
    disc = discriminator()
    with pytest.raises(UnsupportedError, match=r"several optimizers.*unimp.apply\(policy, discriminator, d_opt"):
        unimp.apply("mixed_fp16", disc, [adam(), adam()])
    assert all(layer.dtype_policy.name == "float32" for layer in disc.layers)


def fit(gan, batches):
    if keras.backend.backend() == "jax":
        jax_fit(gan, batches)
    else:
        gan.fit(batches, batch_size=4, epochs=1, shuffle=False, verbose=0)


@pytest.mark.parametrize(("preset", "stray"), [("keras_mixed_float16", "passed_to_apply"),
                                               ("keras_mixed_float16", "new"), ("pure_bf16", "new")])
def test_keras_dcgan_plain_optimizer_on_an_applied_model_refused_at_its_first_step(preset, stray):
    """Issue 32, keras.io's DCGAN with the discriminator under unimp: a train_step stepping the discriminator with
    a plain optimizer (the one passed to unimp.apply instead of amp_d.optimizer, or another one) is refused at its
    first apply (TensorFlow, torch: under fit; JAX: traced in jit), naming the fix, before any weight or slot
    changes: the policy's loss scaling would not run (or a scaled gradient would be applied), or under pure_bf16
    its update of the bf16 copies would be overwritten from the fp32 masters. The wrapper then trains."""
    keras.utils.set_random_seed(0)
    disc, gen = discriminator(), generator()
    d_opt = adam()
    amp_d = unimp.apply(preset, disc, d_opt)
    plain = d_opt if stray == "passed_to_apply" else adam()
    gan = GAN(disc, gen)
    gan.compile(plain, adam(), keras.losses.BinaryCrossentropy())
    before = weights(disc, gen)
    match = (r"Adam.(stateless_)?apply\(\): this optimizer was passed to unimp.apply.*step the wrapper"
             if stray == "passed_to_apply" else
             r"Adam.(stateless_)?apply\(\): this optimizer steps 'discriminator/.*' of a Sequential under the unimp "
             + (r"policy 'pure_bf16'.*would be lost" if preset == "pure_bf16" else
                r"policy 'keras_mixed_float16'.*loss scaling would not run") + r".*amp_d = unimp.apply")
    with pytest.raises(UnsupportedError, match=match):
        fit(gan, data(1))
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(disc, gen), strict=True))
    assert all(not np.any(keras.ops.convert_to_numpy(v)) for v in plain.variables[2:])  # no slot moved
    gan.compile(amp_d.optimizer, adam(), keras.losses.BinaryCrossentropy())
    fit(gan, data(1))
    assert any(not np.array_equal(a, b) for a, b in zip(before, weights(disc), strict=True))
    amp_d.remove()


def test_keras_dcgan_plain_optimizers_kept_without_scaling_or_masters_match_native_bitwise():
    """Where nothing is scaled and there are no masters (keras_mixed_float16 with loss scaling off: Keras'
    mixed_float16 without a LossScaleOptimizer), the DCGAN's plain optimizers step both applied sub-models exactly
    as under Keras' own dtype policy; the guard on Keras' optimizers is gone after the last remove()."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    own = BaseOptimizer.__dict__["apply"], BaseOptimizer.__dict__["stateless_apply"]
    keras.utils.set_random_seed(0)
    disc, gen = discriminator(), generator()
    native_d, native_g = discriminator("mixed_float16"), generator("mixed_float16")
    native_d.set_weights(disc.get_weights())
    native_g.set_weights(gen.get_weights())
    policy = {"extends": "keras_mixed_float16", "loss_scale": {"mode": "none"}}
    amps = [unimp.apply(policy, disc), unimp.apply(policy, gen)]
    assert BaseOptimizer.__dict__["apply"] is not own[0]
    for d, g in ((disc, gen), (native_d, native_g)):
        gan = GAN(d, g)
        gan.compile(adam(), adam(), keras.losses.BinaryCrossentropy())
        fit(gan, data(3))
    assert all(np.array_equal(a, b) for a, b in zip(weights(disc, gen), weights(native_d, native_g), strict=True))
    for amp in amps:
        amp.remove()
    assert (BaseOptimizer.__dict__["apply"], BaseOptimizer.__dict__["stateless_apply"]) == own
