"""What ``amp.watch(every=100)`` costs a Keras 3 training step on CPU, per Keras backend: a small functional
transformer (keras.layers) trained with ``train_on_batch`` (the train function ``fit`` runs: jitted on JAX,
``tf.function`` on TensorFlow, eager on torch).

    KERAS_BACKEND=tensorflow|jax|torch python bench/watch_overhead_keras.py [--steps 300] [--every 100] [--localize]

The method of ``bench/watch_overhead.py`` (torch): in one process, builds from the same weights: ``plain``
(unimp.apply, no watch), ``plain2`` (a second unwatched build: the A/A control, i.e. the noise), ``watched``
(``amp.watch(every=100)``) and, with ``--localize``, ``localize`` (every step tapped). Each training step of
each build is timed alone, the builds taking turns step by step in a rotating order; per build the median
step, and for a watched build the medians of its sampled steps and of the others, combined as what a run of
``every`` steps costs: ``(sampled + (every - 1) x other) / every``, over ``plain``'s median with the A/A
ratio beside it. Time: the process's CPU time, one thread (``--wall``: wall time). The watch starts before
the warm-up, so the tapped train function is compiled there (its first sampled step).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import keras
import numpy as np
from _turns import arguments, header, line, run_builds

import unimp


def one_thread() -> None:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif backend == "torch":
        import torch

        torch.set_num_threads(1)


class Positions(keras.layers.Layer):
    """A learned position embedding added to the token embeddings."""

    def __init__(self, seq: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.seq = seq

    def build(self, shape: tuple) -> None:
        self.table = self.add_weight(shape=(self.seq, shape[-1]), initializer="random_normal", name="table")

    def call(self, x: object) -> object:
        return x + keras.ops.cast(self.table, x.dtype)[None]


def transformer(vocab: int, d: int, layers: int, heads: int, seq: int) -> keras.Model:
    """Token and position embeddings, post-LN blocks (MultiHeadAttention, a GELU MLP), a vocabulary head."""
    ids = keras.Input((seq,), dtype="int32")
    x = Positions(seq, name="wpe")(keras.layers.Embedding(vocab, d, name="wte")(ids))
    for i in range(layers):
        a = keras.layers.MultiHeadAttention(heads, d // heads, name=f"h{i}_attn")(x, x, use_causal_mask=True)
        x = keras.layers.LayerNormalization(name=f"h{i}_ln1")(x + a)
        m = keras.layers.Dense(4 * d, activation="gelu", name=f"h{i}_fc")(x)
        x = keras.layers.LayerNormalization(name=f"h{i}_ln2")(x + keras.layers.Dense(d, name=f"h{i}_proj")(m))
    return keras.Model(ids, keras.layers.Dense(vocab, name="head")(x))


def variant(weights: list, args: argparse.Namespace, ids: np.ndarray, **watch: object):
    model = transformer(512, args.d, args.layers, 4, args.seq)
    model.set_weights(weights)
    amp = unimp.apply(args.policy, model, keras.optimizers.AdamW(1e-4))
    model.compile(optimizer=amp.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if watch:
        amp.watch(**watch)

    def step() -> None:
        model.train_on_batch(ids, ids)

    step.amp = amp  # type: ignore[attr-defined]
    return step


def main() -> None:
    ap = arguments()
    ap.add_argument("--policy", default="mixed_bf16")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # alignment findings
    one_thread()
    keras.utils.set_random_seed(0)
    weights = transformer(512, args.d, args.layers, 4, args.seq).get_weights()
    ids = np.random.default_rng(0).integers(0, 512, (args.batch, args.seq)).astype("int32")
    clock = time.perf_counter if args.wall else time.process_time
    print(f"Keras {keras.__version__} on {keras.backend.backend()}: transformer d={args.d} layers={args.layers} "
          f"batch={args.batch}x{args.seq}, {args.policy}, 1 thread; {args.steps} steps per build, taking turns "
          f"({'wall' if args.wall else 'CPU'} ms per step)")
    times, sampled = run_builds(functools.partial(variant, weights, args, ids), args, clock)
    print(header("backend", list(sampled)))
    print(line(keras.backend.backend(), times, sampled, args.every), flush=True)

if __name__ == "__main__":
    main()
