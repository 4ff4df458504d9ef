"""Data-parallel Keras training under one unimp policy: tf.distribute.MirroredStrategy, 2 CPU replicas.

    python examples/keras_distributed.py [policy.toml]

The CPU is split into two logical devices (before TensorFlow initialises them), so this runs on
any machine; on GPUs use ``MirroredStrategy()`` as usual. Model and optimizer are created inside
``strategy.scope()`` and ``unimp.apply`` binds the policy there: the loss-scale state is mirrored,
gradients are summed across replicas in ``[distributed] reduce_dtype`` (bfloat16 here), and the
finiteness decision is agreed, so an overflow on replica 1 alone makes both replicas skip the step.
Trains with ``fit``, then with a custom ``strategy.run`` loop (``amp.scale_loss`` /
``amp.apply_gradients``) that poisons replica 1's gradients at one step, and prints losses and
scales next to the core's reference trajectory.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import unimp  # noqa: E402
from unimp.loss_scale import LossScale  # noqa: E402

GLOBAL_BATCH, STEPS, POISON = 64, 8, 4
POLICY = {"name": "team-distributed", "extends": "mixed_bf16", "layout": {"on_misaligned": "ignore"},
          "loss_scale": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 3, "skip_nonfinite": True},
          "distributed": {"reduce_dtype": "bfloat16"}}


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(128, activation="relu", name="fc1"),
                             keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(8, name="head")],
                            name="dp_example")


def main() -> None:
    policy = unimp.load(sys.argv[1]) if len(sys.argv) > 1 else unimp.load(POLICY)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 32)).astype("float32")
    y = (x[:, :8].argmax(-1)).astype("int32")
    print(f"{strategy.num_replicas_in_sync} replicas, policy {policy.name} "
          f"(compute {policy.compute_dtype}, reduce {policy.distributed.reduce_dtype}, "
          f"fingerprint {policy.fingerprint[:12]})")

    # --- compile + fit
    with strategy.scope():
        amp = unimp.apply(policy, make_model(), keras.optimizers.Adam(1e-3))
        amp.model.compile(optimizer=amp.optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = amp.model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, shuffle=False, verbose=0)
    print("fit  losses per epoch:", " ".join(f"{v:.4f}" for v in hist.history["loss"]),
          "| scale", amp.scale, "| state", amp.loss_scale_state())
    print(amp.plan.details.distributed)

    # --- custom loop, replica 1 overflows at step POISON
    with strategy.scope():
        amp = unimp.apply(policy, make_model(), keras.optimizers.Adam(1e-3))
    tvs = amp.model.trainable_variables

    @tf.function
    def train_step(xb, yb, poison):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                per = keras.losses.sparse_categorical_crossentropy(yb, amp.model(xb, training=True),
                                                                   from_logits=True)
                loss = tf.nn.compute_average_loss(per, global_batch_size=GLOBAL_BATCH)
                rid = tf.distribute.get_replica_context().replica_id_in_sync_group
                bad = tf.logical_and(poison, tf.equal(rid, 1))
                scaled = amp.scale_loss(loss * tf.where(bad, np.inf, 1.0))
            grads = tape.gradient(scaled, tvs)
            amp.apply_gradients(zip(grads, tvs))
            return loss
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(xb, yb)), axis=None)

    data = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    expected = [o.scale for o in LossScale(policy.loss_scale).replay(i != POISON for i in range(STEPS))]
    print("step  loss     scale(replica 0, 1)  core reference  skipped")
    for step, (xb, yb) in enumerate(data):
        loss = train_step(xb, yb, tf.constant(step == POISON))
        scales = [float(v.numpy()) for v in amp.optimizer.dynamic_scale.value.values]
        same = all(len({c.numpy().tobytes() for c in v.value.values}) == 1 for v in tvs)
        print(f"{step:4d}  {float(loss):.4f}  {scales}  {expected[step]:>14}  "
              f"{amp.skipped_steps}{'  <- overflow on replica 1 only' if step == POISON else ''}"
              f"{'' if same else '  REPLICAS DIFFER'}")
    print("final state:", amp.loss_scale_state())


if __name__ == "__main__":
    main()
