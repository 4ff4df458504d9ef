"""FP8 training with Keras (TensorFlow backend) through a unimp preset, next to bf16 (CPU: emulated).

    python examples/fp8_keras.py [--epochs 10] [--policy fp8_delayed]

unimp turns the Plan's FP8 layers into Keras' own float8 ``Dense`` (``quantize("float8")``: delayed
scaling from an amax history); the rest runs bf16. Prints the report and the losses against ``mixed_bf16``.
"""

from __future__ import annotations

import fp8_compare  # examples/fp8_compare.py, beside this file
import keras
import numpy as np

import unimp


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="gelu", name="fc1"),
                             keras.layers.Dense(64, activation="gelu", name="fc2"),
                             keras.layers.Dense(16, name="head")])


def train(policy: str, epochs: int) -> tuple[list[float], unimp.Amp]:
    m = model()
    amp = unimp.apply(policy, m, keras.optimizers.Adam(3e-3))
    m.compile(optimizer=amp.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((256, 64)).astype("float32"), rng.integers(0, 16, 256)
    return m.fit(x, y, epochs=epochs, batch_size=256, verbose=0).history["loss"], amp


def main(argv: list[str] | None = None) -> tuple[list[float], list[float]]:
    return fp8_compare.main(__doc__, train, "epochs", "fp8_delayed", argv)


if __name__ == "__main__":
    main()
