"""BatchNorm under unimp's ``mixed_fp16`` vs Keras' own ``mixed_float16``: final-loss distributions.

keras.applications MobileNetV2 (``weights=None``, 32x32 input, alpha 0.35, 4 classes), batch 4, a fixed
synthetic learnable dataset (4 class templates + noise, the same for every run), Adam(1e-3), ``compile`` +
``fit`` (Keras' default ``jit_compile="auto"``), per seed the same initial weights for both sides; the final
loss is the mean training loss of the last epoch (the last 50 of the 200 steps).
unimp = ``unimp.apply("mixed_fp16", model, Adam)``; Keras = the model built under
``keras.config.set_dtype_policy("mixed_float16")`` + ``keras.optimizers.LossScaleOptimizer(Adam)``. It prints
the per-seed final losses, the medians, on how many seeds the two are bit-identical, and each side's
BatchNorm / Add output dtypes.

    KERAS_BACKEND=jax python bench/keras_batchnorm.py --seeds 5 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics

import keras
import numpy as np

import unimp
from unimp_keras.testing import built_under

N, CLASSES, SIZE, BATCH = 200, 4, 32, 4


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    templates = rng.normal(size=(CLASSES, SIZE, SIZE, 3)).astype("float32")
    y = rng.integers(0, CLASSES, N)
    x = templates[y] + 0.3 * rng.normal(size=(N, SIZE, SIZE, 3)).astype("float32")
    return x, y


def build(policy: str, seed: int) -> keras.Model:
    return built_under(policy, lambda: keras.applications.MobileNetV2(
        input_shape=(SIZE, SIZE, 3), alpha=0.35, weights=None, classes=CLASSES), seed=seed)


def fit(model: keras.Model, optimizer: keras.optimizers.Optimizer, steps: int) -> float:
    """Train ``steps`` steps (batches in a fixed order); the final loss: the mean training loss of the last
    epoch (50 steps; MobileNetV2's BatchNorm momentum 0.999 leaves its moving statistics near their
    initial values after 200 steps, so an inference-mode loss would measure those)."""
    x, y = data()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=False))
    hist = model.fit(x, y, batch_size=BATCH, epochs=steps // (N // BATCH), verbose=0, shuffle=False)
    return float(hist.history["loss"][-1])


def bn_dtypes(model: keras.Model) -> dict[str, str]:
    """Output dtype of the first BatchNormalization and the first Add (a recorded call, not unimp's report)."""
    out: dict[str, str] = {}
    x, _ = data()
    for cls in (keras.layers.BatchNormalization, keras.layers.Add):
        layer = next(la for la in model._flatten_layers() if isinstance(la, cls))
        sub = keras.Model(model.input, layer.output)
        out[cls.__name__] = keras.backend.standardize_dtype(sub(x[:1]).dtype)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--keras-only-initial", type=float, default=None,
                    help="train Keras' own side only, with LossScaleOptimizer(initial_scale=...) (the control "
                         "of bench/keras.md: 2**16, where mixed_fp16 started on Keras before initial = 'auto')")
    args = ap.parse_args()
    if args.keras_only_initial is not None:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            native, ref = build("mixed_float16", seed), build("float32", seed)
            native.set_weights(ref.get_weights())
            initial = args.keras_only_initial
            opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=initial)
            loss = fit(native, opt, args.steps)
            print(f"seed {seed}: keras initial_scale={initial:g} {loss:.4f}", flush=True)
        return
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        ref = build("float32", seed)
        native = build("mixed_float16", seed)
        native.set_weights(ref.get_weights())
        keras_losses = fit(native, keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-3)), args.steps)
        amp = unimp.apply("mixed_fp16", ref, keras.optimizers.Adam(1e-3))
        unimp_losses = fit(ref, amp.optimizer, args.steps)
        if seed == args.first_seed:
            print("dtypes keras:", bn_dtypes(native), "unimp:", bn_dtypes(ref))
        amp.remove()
        rows.append((seed, keras_losses, unimp_losses))
        print(f"seed {seed}: keras {keras_losses:.4f} unimp {unimp_losses:.4f}", flush=True)
    k, u = statistics.median(r[1] for r in rows), statistics.median(r[2] for r in rows)
    above, equal = sum(r[2] > r[1] for r in rows), sum(r[2] == r[1] for r in rows)
    print(f"median final loss: keras {k:.4f}, unimp {u:.4f} ({'<=' if u <= k else '>'}); "
          f"unimp above keras on {above} of {len(rows)} seeds, bit-identical on {equal}")
    print(json.dumps({"backend": keras.backend.backend(), "rows": rows,
                      "median_keras": k, "median_unimp": u}))


if __name__ == "__main__":
    main()
