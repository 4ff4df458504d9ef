"""Run in a fresh process by test_distributed.py: 2 logical CPU devices, MirroredStrategy, JSON out.

TensorFlow fixes its logical devices when it first initialises them, so this script splits the
CPU into two before anything else touches TensorFlow. It only *measures* (losses, scales,
per-replica variable hashes, errors); every expectation is computed by the test from the core.

    python distributed_worker.py OUT.json
"""

import hashlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402

# One strategy for the whole process: separate MirroredStrategy objects reuse collective instance
# keys, and their all-reduces then collide ("Shape mismatch in the collective instance").
MIRRORED = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
GLOBAL = 16
STEPS = 8
POISON_STEP = 3  # 0-based step whose gradients are made non-finite (on replica 1 only when mirrored)
POLICY = {"name": "dist-fp16", "extends": "mixed_fp16",
          "loss_scale": {"initial": 1024.0, "growth_interval": 2}, "layout": {"on_misaligned": "ignore"}}
PURE = {"name": "dist-pure-bf16", "extends": "pure_bf16", "layout": {"on_misaligned": "ignore"},
        "loss_scale": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 2, "skip_nonfinite": True}}
rng = np.random.default_rng(0)
X = rng.normal(size=(GLOBAL, 12)).astype("float32")
Y = rng.integers(0, 4, size=(GLOBAL,)).astype("int32")
WEIGHTS = [rng.normal(scale=0.3, size=s).astype("float32") for s in ((12, 32), (32,), (32,), (32,), (32, 4), (4,))]


def make_model():
    m = keras.Sequential([keras.Input((12,)), keras.layers.Dense(32, name="fc1"), keras.layers.ReLU(name="act"),
                          keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(4, name="head")],
                         name="net")
    m.set_weights(WEIGHTS)
    return m


def components(var):
    """Per-replica copies of a (Keras or tf) variable: the MirroredVariable's values, else itself."""
    v = getattr(var, "value", var)
    return list(getattr(v, "values", (v,)))


def digest(variables):
    """One sha256 per replica over the raw bytes of every variable."""
    per = None
    for var in variables:
        comps = components(var)
        per = per or [hashlib.sha256() for _ in comps]
        for h, c in zip(per, comps, strict=True):
            h.update(np.asarray(c.numpy()).tobytes())
    return [h.hexdigest() for h in per]


def split(strategy, array):
    n = strategy.num_replicas_in_sync
    if n == 1:
        return tf.constant(array)
    per = len(array) // n
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(array[ctx.replica_id_in_sync_group * per:(ctx.replica_id_in_sync_group + 1) * per]))


def custom_loop(mirrored, poison, policy=POLICY, steps=STEPS):
    strategy = MIRRORED if mirrored else tf.distribute.get_strategy()
    with strategy.scope():
        model = make_model()
        opt = keras.optimizers.Adam(1e-2)
        amp = unimp.apply(policy, model, opt)
    tvs = amp.model.trainable_variables

    @tf.function
    def train_step(x, y, bad_step):
        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                # the head's output is left in its compute dtype (as Keras does): the loss in float32
                logits = tf.cast(amp.model(x, training=True), tf.float32)
                per = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
                loss = tf.reduce_sum(per) / GLOBAL
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                bad = tf.logical_and(bad_step, tf.equal(rid, strategy.num_replicas_in_sync - 1))
                scaled = amp.scale_loss(loss * tf.where(bad, np.inf, 1.0))  # poison this replica's grads
            grads = tape.gradient(scaled, tvs)
            amp.apply_gradients(zip(grads, tvs))
            return loss
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    x, y = split(strategy, X), split(strategy, Y)
    out = {"losses": [], "scales": [], "model": [], "opt": [], "skipped": []}
    for step in range(steps):
        loss = train_step(x, y, tf.constant(poison and step == POISON_STEP))
        out["losses"].append(float(loss))
        out["scales"].append([float(c.numpy()) for c in components(amp.optimizer.dynamic_scale)])
        out["skipped"].append([int(c.numpy()) for c in components(amp.optimizer._skipped)])
        out["model"].append(digest(tvs))
        out["opt"].append(digest(amp.optimizer.inner_optimizer.variables))  # slots, iterations
    out["state"] = amp.loss_scale_state().to_dict()
    out["wrapper"] = type(amp.optimizer).__name__
    out["masters"] = [[hashlib.sha256(np.asarray(lo.numpy()).tobytes()).hexdigest(),  # bf16 param
                       hashlib.sha256(np.asarray(ma.numpy()).astype(ml_dtypes.bfloat16).tobytes()).hexdigest()]
                      for v, m in getattr(amp.optimizer, "_masters", {}).items()
                      for lo, ma in zip(components(_by_id(tvs, v)), components(m), strict=True)]
    return out


def _by_id(variables, key):
    return next(v for v in variables if id(v) == key)


class StepLoss(keras.callbacks.Callback):
    """Per-step losses from fit: the loss tracker is reset before each batch (one epoch, many steps)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_begin(self, batch, logs=None):
        self.model._loss_tracker.reset_state()

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit(steps=6):
    """model.fit under MirroredStrategy: one epoch of ``steps`` global batches (the same 16 rows)."""
    with MIRRORED.scope():
        model = make_model()
        amp = unimp.apply(POLICY, model, keras.optimizers.Adam(1e-2))
        amp.model.compile(optimizer=amp.optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = StepLoss()
    amp.model.fit(np.tile(X, (steps, 1)), np.tile(Y, steps), batch_size=GLOBAL, epochs=1, shuffle=False,
                  verbose=0, callbacks=[cb])
    return {"losses": cb.losses, "scales": [float(c.numpy()) for c in components(amp.optimizer.dynamic_scale)],
            "state": amp.loss_scale_state().to_dict(), "model": digest(amp.model.trainable_variables),
            "jit_compile": bool(amp.model.jit_compile)}


def reduce_dtype(dtype):
    """Per-replica gradient 1 + 2**-12 (exact in float32, 1.0 in bf16/fp16); SGD(lr=1) from w = 0."""
    strategy = MIRRORED
    with strategy.scope():
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False, name="w",
                                                                        kernel_initializer="zeros")])
        amp = unimp.apply({"extends": "fp32", "distributed": {"reduce_dtype": dtype}}, model,
                          keras.optimizers.SGD(1.0))
    x = split(strategy, np.full((2, 1), 1 + 2.0 ** -12, "float32"))

    @tf.function
    def step(x):
        def replica_fn(x):
            with tf.GradientTape() as tape:
                loss = amp.scale_loss(tf.reduce_sum(amp.model(x)))
            g = tape.gradient(loss, amp.model.trainable_variables)
            amp.apply_gradients(zip(g, amp.model.trainable_variables))
        strategy.run(replica_fn, args=(x,))

    step(x)
    return {"w": [float(c.numpy()[0, 0]) for c in components(amp.model.trainable_variables[0])],
            "note": amp.plan.details.distributed}


def errors():
    out = {}
    strategy = MIRRORED
    with strategy.scope():
        model = make_model()
        amp = unimp.apply(POLICY, model, keras.optimizers.SGD(0.1))
        amp.model.compile(optimizer=amp.optimizer, jit_compile=True,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        amp.model.fit(X, Y, batch_size=GLOBAL, epochs=1, verbose=0)
        out["jit"] = "no error"
    except Exception as e:
        out["jit"] = f"{type(e).__name__}: {e}"
    for native in (None, True):
        with strategy.scope():
            model = make_model()
            try:
                a = unimp.apply("keras_mixed_float16", model, keras.optimizers.SGD(0.1), native_loss_scale=native)
                out[f"native_{native}"] = type(a.optimizer).__name__
            except Exception as e:
                out[f"native_{native}"] = f"{type(e).__name__}: {e}"
    model = make_model()  # outside the scope
    with strategy.scope():
        opt = keras.optimizers.SGD(0.1)
    try:
        unimp.apply(POLICY, model, opt)
        out["mixed_scopes"] = "no error"
    except Exception as e:
        out["mixed_scopes"] = f"{type(e).__name__}: {e}"
    return out


def main(path):
    res = {"replicas": len(tf.config.list_logical_devices("CPU")), "policy": POLICY, "pure_policy": PURE,
           "poison_step": POISON_STEP, "global_batch": GLOBAL,
           "single": custom_loop(False, False), "mirrored": custom_loop(True, False),
           "single_poison": custom_loop(False, True), "mirrored_poison": custom_loop(True, True),
           "pure_single": custom_loop(False, True, PURE, 5), "pure_mirrored": custom_loop(True, True, PURE, 5),
           "fit_mirrored": fit(),
           "reduce": {d: reduce_dtype(d) for d in ("float32", "bfloat16", "float16")},
           "errors": errors()}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
