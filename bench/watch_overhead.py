"""What ``amp.watch(every=100)`` costs a training step: a small HF GPT-2 on CPU, eager and ``torch.compile``.

    python bench/watch_overhead.py [--steps 1000] [--every 100] [--localize] [--compile-only | --eager-only]
    python bench/watch_overhead.py --device cuda --d 1024 --layers 8 --batch 8 --seq 512 --steps 400   # H200

Builds from the same weights, in one process: ``plain`` (unimp.apply, no watch), ``plain2`` (a second
unwatched build: the A/A control, i.e. the noise), ``watched`` (``amp.watch(every=100)``) and, with
``--localize``, ``localize`` (``amp.watch(every=100, localize=True)``: every layer checked on every step).
Each training step (forward, ``amp.backward``, ``amp.optimizer.step()``, zero_grad) of each build is timed
alone, the builds taking turns step by step in a rotating order, so drift of the machine reaches them
alike. Per build: the median step, and for a watched build the median of its sampled steps and of the
others; a watched build's cost per step is ``(median sampled + (every - 1) x median other) / every``
(what a run of ``every`` steps costs, from medians), reported over ``plain``'s median with the A/A ratio
beside it. Time is the process's CPU time (``time.process_time``; one thread, so it is the step's own
work): on a shared machine wall time moves with the other processes far more than the effect measured
(``--wall``: wall time). On a GPU (``--device cuda``) each step is timed in wall time between two
``torch.cuda.synchronize()`` (the same for every build). Compiled: ``torch.compile`` of each build's
``amp.model`` (inductor), warmed up over ``every`` steps first (the watched builds compile their sampled-step
graph there too).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable

import torch
import transformers
from _turns import arguments, header, line, measure

import unimp


def build(d: int, layers: int, seq: int = 256) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=max(256, seq), n_embd=d, n_layer=layers,
                                  n_head=max(4, d // 64),
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


def main() -> None:
    ap = arguments(steps=1000, warmup=None)
    ap.add_argument("--policy", default="mixed_bf16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (wall time between synchronizations)")
    ap.add_argument("--eager-counting", choices=("default", "at-once"), default="default",
                    help="at-once: the eager counting off the CPU without torch.compile (the comparison for the "
                         "compiled counting kernel CUDA uses by default)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--eager-only", action="store_true")
    mode.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # alignment findings of the tiny config
    if args.eager_counting == "at-once":
        import unimp_torch.watch

        unimp_torch.watch._COUNTED_FUSED = frozenset()
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(1)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    base = build(args.d, args.layers, args.seq).to(device)
    wall = args.wall or gpu
    clock = time.perf_counter if wall else time.process_time
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    where = torch.cuda.get_device_name(device) if gpu else "1 thread"
    print(f"GPT-2 d={args.d} layers={args.layers} batch={args.batch}x{args.seq}, {args.policy}, torch "
          f"{torch.__version__}, {where}; {args.steps} steps per build, taking turns "
          f"({'wall' if wall else 'CPU'} ms per step)")
    watched = ["watched", *(["localize"] if args.localize else [])]
    print(header("mode", watched))
    modes = [m for m in ("eager", "compiled") if not (m == "eager" and args.compile_only)
             and not (m == "compiled" and args.eager_only)]
    for m in modes:
        compiled = m == "compiled"
        steps = {"plain": variant(base, args.policy, batch, compiled),
                 "plain2": variant(base, args.policy, batch, compiled),
                 "watched": variant(base, args.policy, batch, compiled, every=args.every)}
        if args.localize:
            steps["localize"] = variant(base, args.policy, batch, compiled, every=args.every, localize=True)
        for step in steps.values():  # warm-up: compiles (every graph of a watched build), allocator
            for _ in range(args.every):
                step()
        times = measure(steps, args.steps, clock, sync)
        first = args.every  # the watch's first sampled step was the first warm-up step
        sampled = {name: {i for i in range(args.steps) if (first + i) % args.every == 0}
                   for name, step in steps.items() if getattr(step.amp, "_watch", None) is not None}
        print(line(m, times, sampled, args.every), flush=True)

if __name__ == "__main__":
    main()
