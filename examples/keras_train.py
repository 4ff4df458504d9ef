"""Train a small Keras model under the team's shared unimp policy (the training loop of docs/design.md).

    python examples/keras_train.py [policy.toml]

Uses examples/team_policy.toml when present (else the mixed_bf16 preset). The model is built in
float32 as usual; ``unimp.apply`` sets per-layer dtype policies and wraps the optimizer. It trains
once with ``compile`` + ``fit`` and once with a custom ``tf.GradientTape`` loop under
``tf.function``, then prints the report, the losses and time per step against float32.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import unimp

HERE = Path(__file__).resolve().parent
B, T, D, C = 64, 32, 256, 8


def make_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((T, D))
    x = keras.layers.Dense(512, activation="relu", name="fc1")(inp)
    x = keras.layers.Conv1D(256, 3, padding="same", name="conv")(x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inp, keras.layers.Dense(C, name="head")(x), name="example")


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B * 8, T, D)).astype("float32")
    return x, (x[:, :, :C].mean(1).argmax(-1)).astype("int32")


def custom_loop(amp: unimp.Amp, x: np.ndarray, y: np.ndarray, steps: int) -> tuple[list[float], float]:
    """The TensorFlow training loop of docs/design.md: scale_loss -> tape.gradient -> apply_gradients."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = amp.model.trainable_variables

    @tf.function
    def step(xb: tf.Tensor, yb: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, amp.model(xb, training=True))
            scaled = amp.scale_loss(loss)
        amp.apply_gradients(zip(tape.gradient(scaled, variables), variables))
        return loss

    losses, times = [], []
    for i in range(steps):
        j = (i % 8) * B
        t0 = time.perf_counter()
        losses.append(float(step(x[j:j + B], y[j:j + B])))
        times.append(time.perf_counter() - t0)
    return losses, float(np.median(times[2:])) * 1e3


def run(policy: unimp.Policy, steps: int = 12) -> tuple[unimp.Amp, list[float], float]:
    x, y = data()
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.UnimpWarning)  # alignment findings end up in the report
        amp = unimp.apply(policy, model, keras.optimizers.Adam(1e-3))
    losses, ms = custom_loop(amp, x, y, steps)
    return amp, losses, ms


def main(path: str | None = None) -> None:
    team = HERE / "team_policy.toml"
    policy = unimp.load(path or (str(team) if team.exists() else "mixed_bf16"))
    print(f"policy {policy.name!r} ({policy.fingerprint}) from {policy.source}\n")

    amp, losses, ms = run(policy)
    print(amp.plan, "\n")
    print(amp.report(data()[0][:2]), "\n")
    print("custom tf.GradientTape loop, losses:", " ".join(f"{v:.4f}" for v in losses))

    amp.model.compile(optimizer=amp.optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = amp.model.fit(*data(), batch_size=B, epochs=2, verbose=0)
    print("compile + fit, epoch losses:      ", " ".join(f"{v:.4f}" for v in hist.history["loss"]))
    print("state_dict:", amp.state_dict())
    amp.remove()

    _, base_losses, base_ms = run(unimp.load("fp32"))
    print(f"\ntime/step (custom loop, median): {policy.name} {ms:.1f} ms, fp32 {base_ms:.1f} ms "
          f"({base_ms / ms:.2f}x)")
    print(f"final loss: {policy.name} {losses[-1]:.4f}, fp32 {base_losses[-1]:.4f}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
