"""What ``amp.watch(every=100)`` costs a training step: a small HF GPT-2 on CPU, eager and ``torch.compile``.

    python bench/watch_overhead.py [--blocks 15] [--every 100] [--localize] [--compile-only | --eager-only]

Builds from the same weights, in one process: ``plain`` (unimp.apply, no watch), ``plain2`` (a second
unwatched build: the A/A control, i.e. the noise), ``watched`` (``amp.watch(every=100)``) and, with
``--localize``, ``localize`` (``amp.watch(every=100, localize=True)``: every layer checked on every step).
A block is ``every`` training steps (forward, ``amp.backward``, ``amp.optimizer.step()``, zero_grad),
so each watched block holds exactly one sampled step; blocks of the builds run in a rotating order and
the median block time per step is reported, with the ratios to ``plain``. Time is the process's CPU time
(``time.process_time``; one thread, so it is the step's own work): on a shared machine wall time moves
with the other processes far more than the effect measured here (``--wall`` reports wall time instead).
Compiled: ``torch.compile`` of each build's ``amp.model`` (inductor), warmed up over one block first (the
watched builds compile their sampled-step graph there too).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import transformers

import unimp


def build(d: int, layers: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=256, n_embd=d, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def variant(base: torch.nn.Module, policy: str, batch: dict, compiled: bool, **watch: object) -> Callable[[], None]:
    model = copy.deepcopy(base)
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), 1e-4))
    if watch:
        amp.watch(**watch)
    run = torch.compile(amp.model) if compiled else amp.model

    def step() -> None:
        loss = run(**batch).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    step.amp = amp  # type: ignore[attr-defined]
    return step


def measure(steps: dict[str, Callable[[], None]], blocks: int, every: int,
            clock: Callable[[], float] = time.process_time) -> dict[str, float]:
    """Median over blocks of the per-step time of a block of ``every`` steps (ms), builds rotating."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            t = clock()
            for _ in range(every):
                steps[n]()
            times[n].append((clock() - t) / every)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--policy", default="mixed_bf16")
    ap.add_argument("--localize", action="store_true", help="also a build watched with localize=True")
    ap.add_argument("--wall", action="store_true", help="wall time instead of the process's CPU time")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--eager-only", action="store_true")
    mode.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # alignment findings of the tiny config
    torch.set_num_threads(1)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    base = build(args.d, args.layers)
    clock = time.perf_counter if args.wall else time.process_time
    print(f"GPT-2 d={args.d} layers={args.layers} batch={args.batch}x{args.seq}, {args.policy}, torch "
          f"{torch.__version__}, 1 thread; median over {args.blocks} blocks of {args.every} steps "
          f"({'wall' if args.wall else 'CPU'} ms per step)")
    print("| mode | plain | plain2 (A/A) | watched | watched/plain | A/A plain2/plain |"
          + (" localize | localize/plain |" if args.localize else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if args.localize else ""))
    modes = [m for m in ("eager", "compiled") if not (m == "eager" and args.compile_only)
             and not (m == "compiled" and args.eager_only)]
    for m in modes:
        compiled = m == "compiled"
        steps = {"plain": variant(base, args.policy, batch, compiled),
                 "plain2": variant(base, args.policy, batch, compiled),
                 "watched": variant(base, args.policy, batch, compiled, every=args.every)}
        if args.localize:
            steps["localize"] = variant(base, args.policy, batch, compiled, every=args.every, localize=True)
        for step in steps.values():  # warm-up: compiles (both graphs of a watched build), allocator
            for _ in range(args.every):
                step()
        ms = measure(steps, args.blocks, args.every, clock)
        sampled = len(steps["watched"].amp._watch.records)
        loc = (f" {ms['localize']:.3f} | {ms['localize'] / ms['plain']:.3f} |" if args.localize else "")
        print(f"| {m} | {ms['plain']:.3f} | {ms['plain2']:.3f} | {ms['watched']:.3f} | "
              f"{ms['watched'] / ms['plain']:.3f} | {ms['plain2'] / ms['plain']:.3f} |{loc}"
              f" <!-- {sampled} sampled steps recorded -->", flush=True)


if __name__ == "__main__":
    main()
