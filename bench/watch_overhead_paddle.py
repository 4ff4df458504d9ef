"""What ``amp.watch(every=100)`` costs a Paddle dygraph training step: a small GPT (paddle.nn) on CPU.

    python bench/watch_overhead_paddle.py [--steps 300] [--every 100] [--localize]

The method of ``bench/watch_overhead.py`` (torch), on Paddle: builds from the same weights, in one process:
``plain`` (unimp.apply, no watch), ``plain2`` (a second unwatched build: the A/A control, i.e. the noise),
``watched`` (``amp.watch(every=100)``) and, with ``--localize``, ``localize`` (every layer checked on every
step). Each training step (forward, ``amp.backward``, ``amp.optimizer.step()``, ``clear_grad``) of each
build is timed alone, the builds taking turns step by step in a rotating order; per build the median step,
and for a watched build the medians of its sampled steps and of the others, combined as what a run of
``every`` steps costs: ``(sampled + (every - 1) x other) / every``, over ``plain``'s median with the A/A
ratio beside it. Time: the process's CPU time on one thread (``--wall``: wall time). Policy: ``mixed_fp16``
as Paddle runs it on CPU (its reported fallback: float32 kernels, dynamic loss scaling).
"""

from __future__ import annotations

import copy
import functools
import os
import time
import warnings
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("FLAGS_use_mkldnn", "0")
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np
import paddle
import paddle.nn.functional as F
from _turns import arguments, header, line, run_builds
from paddle import nn

import unimp


class Block(nn.Layer):
    """Pre-LN attention (fused qkv, causal) and MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape([b, t, 3, self.heads, d // self.heads]).transpose(
            [2, 0, 3, 1, 4]).unbind(0)
        att = q.matmul(k, transpose_y=True) / (d // self.heads) ** 0.5 + paddle.triu(
            paddle.full([t, t], float("-inf")), 1)
        x = x + self.proj(F.softmax(att, -1).matmul(v).transpose([0, 2, 1, 3]).reshape([b, t, d]))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class GPT(nn.Layer):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.LayerList([Block(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(paddle.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).astype("float32")
        return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1]))


def variant(base: GPT, policy: dict, ids: paddle.Tensor, **watch: object) -> Callable[[], None]:
    model = copy.deepcopy(base)
    amp = unimp.apply(policy, model, paddle.optimizer.AdamW(1e-4, parameters=model.parameters()))
    if watch:
        amp.watch(**watch)

    def step() -> None:
        amp.backward(amp.model(ids, ids))
        amp.optimizer.step()
        amp.optimizer.clear_grad()

    step.amp = amp  # type: ignore[attr-defined]
    return step


def main() -> None:
    ap = arguments()
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # Paddle's auto_cast-on-CPU warning, alignment findings
    paddle.set_device("cpu")
    paddle.seed(0)
    base = GPT(512, args.d, args.layers, 4, args.seq)
    ids = paddle.to_tensor(np.random.default_rng(0).integers(0, 512, (args.batch, args.seq)), dtype="int64")
    policy = {"extends": "mixed_fp16", "on_unsupported": "fallback"}
    clock = time.perf_counter if args.wall else time.process_time
    print(f"GPT (paddle.nn) d={args.d} layers={args.layers} batch={args.batch}x{args.seq}, mixed_fp16 (CPU "
          f"fallback: float32), paddle {paddle.__version__}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; "
          f"{args.steps} steps per build, taking turns ({'wall' if args.wall else 'CPU'} ms per step)")
    # the watch starts before the warm-up: its sampled steps are warm-up step 0, then every ``every``-th
    times, sampled = run_builds(functools.partial(variant, base, policy, ids), args, clock)
    print(header("", list(sampled)))
    print(line("", times, sampled, args.every), flush=True)

if __name__ == "__main__":
    main()
