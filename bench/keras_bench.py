"""Hand-written native Keras mixed precision vs ``unimp.apply``, side by side in one process (CPU).

    python bench/keras_bench.py [--steps 40] [--rounds 8]

Both models have the same architecture and the same per-layer dtypes: the native one is built
with ``dtype="mixed_bfloat16"`` on Dense/Conv1D and the pooling that follows them (unimp: an
activation-following layer), ``"float32"`` on LayerNormalization and a final
float32 ``Activation("linear")`` (the Keras mixed-precision guide's recipe); the unimp one is
built in float32 and gets the ``mixed_bf16`` preset through ``unimp.apply``. Each is trained with
``compile`` + ``train_on_batch`` (Adam); the float32 model is timed too. Steps are interleaved in
rounds (A, B, fp32, A, B, ...) so machine noise hits all alike; medians after warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import unimp

B, T, D, H, C = 64, 64, 256, 512, 16


def build(low: str | None) -> keras.Model:
    """The bench model; ``low`` = "mixed_bfloat16" sets native per-layer policies by hand."""
    keras.utils.set_random_seed(0)
    pol = low or "float32"
    ly = keras.layers
    inp = keras.Input((T, D))
    x = ly.Dense(H, activation="relu", name="fc1", dtype=pol)(inp)
    x = ly.Conv1D(D, 3, padding="same", name="conv", dtype=pol)(x)
    x = ly.LayerNormalization(name="norm", dtype="float32")(x)
    x = ly.Dense(H, activation="relu", name="fc2", dtype=pol)(x)
    x = ly.GlobalAveragePooling1D(name="pool", dtype=pol)(x)  # follows fc2's output dtype
    x = ly.Dense(C, name="head", dtype=pol)(x)
    if low:
        x = ly.Activation("linear", dtype="float32", name="out")(x)  # float32 outputs, as Keras' guide says
    return keras.Model(inp, x)


def compiled(model: keras.Model, optimizer: keras.optimizers.Optimizer) -> keras.Model:
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    ap.add_argument("--rounds", type=int, default=8, help="interleaving rounds")
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, D)).astype("float32")
    y = rng.integers(0, C, size=(B,)).astype("int32")

    native = compiled(build("mixed_bfloat16"), keras.optimizers.Adam(1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.UnimpWarning)
        model = build(None)
        amp = unimp.apply("mixed_bf16", model, keras.optimizers.Adam(1e-3))
    via_unimp = compiled(amp.model, amp.optimizer)
    fp32 = compiled(build(None), keras.optimizers.Adam(1e-3))
    variants = {"native mixed_bfloat16 (by hand)": native, "unimp.apply(mixed_bf16)": via_unimp, "fp32": fp32}

    for m in variants.values():
        for _ in range(args.warmup):
            m.train_on_batch(x, y)
    times: dict[str, list[float]] = {k: [] for k in variants}
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):
        for name, m in variants.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                m.train_on_batch(x, y)
                times[name].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    nat, uni = med["native mixed_bfloat16 (by hand)"], med["unimp.apply(mixed_bf16)"]
    print(f"Keras {keras.__version__}, model B={B} T={T} D={D} H={H}, {per_round * args.rounds} steps each "
          f"(median ms/step, train_on_batch)")
    for k, v in med.items():
        print(f"  {k:34s} {v:8.2f} ms")
    print(f"  ratio unimp / native = {uni / nat:.3f}  (contract: <= 1.02)")
    print(f"  speed-up over fp32: native {med['fp32'] / nat:.2f}x, unimp {med['fp32'] / uni:.2f}x")
    rows = {r.path: r.compute_dtype for r in amp.report(x[:2]).rows if r.path}
    hand = {layer.name: layer.compute_dtype for layer in native.layers[1:] if layer.name in rows}
    print(f"  same per-layer compute dtypes: {hand == {k: v for k, v in rows.items() if k in hand}} {rows}")


if __name__ == "__main__":
    main()
