"""Where a sampled eager step of ``amp.watch()`` spends its time: wall, the process's CPU and (on a GPU) the
device's time of each step, sampled and not, per way of counting; then torch.profiler's and cProfile's top
entries of one sampled step. The diagnosis behind ``watch_overhead.py``'s eager row.

    python bench/watch_profile.py --device cuda --d 1024 --layers 8 --batch 8 --seq 512   # the H100 row
    python bench/watch_profile.py --d 64 --layers 8 --batch 1 --seq 16                     # CPU smoke test

Counting ways (``--ways``): ``default`` (what the device type uses: on CUDA one compiled reduction per
tensor), ``at-once`` (eager kernels, one broadcast comparison), ``sums`` (no amax or counts: the non-finite
sums and the hooks alone; a diagnosis, not a watch).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time
import warnings

import torch
from watch_overhead import build

import unimp
import unimp_torch.watch as torch_watch


def watched(base: torch.nn.Module, batch: dict, policy: str):
    model = copy.deepcopy(base)
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), 1e-4))
    amp.watch(every=2)  # steps 0, 2, 4, ... sampled

    def step() -> None:
        loss = amp.model(**batch).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    return step, amp


def way(name: str) -> None:
    torch_watch._COUNTED_FUSED = frozenset({"cuda"}) if name == "default" else frozenset()
    if name == "sums":
        def count(self, t, target, scaled):  # the hooks and sums alone
            return t.new_zeros((), dtype=torch.float32), t.new_zeros(7, dtype=torch.int64)
        torch_watch.TorchWatch._count = count
    else:
        torch_watch.TorchWatch._count = ORIGINAL_COUNT


ORIGINAL_COUNT = torch_watch.TorchWatch._count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--policy", default="mixed_bf16")
    ap.add_argument("--ways", default="default,at-once,sums")
    ap.add_argument("--out", default=None, help="also write the report here")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    base = build(args.d, args.layers, args.seq).to(device)
    report = io.StringIO()

    def say(s: str) -> None:
        print(s, flush=True)
        report.write(s + "\n")

    where = torch.cuda.get_device_name(device) if gpu else "CPU"
    say(f"GPT-2 d={args.d} layers={args.layers} batch={args.batch}x{args.seq} {args.policy}, "
        f"torch {torch.__version__}, {where}; watch(every=2), medians of {args.steps // 2} sampled and "
        f"{args.steps // 2} other steps (ms)")
    say("| counting | sampled wall | cpu | device | other wall | cpu | device | measured tensors |")
    say("|---|---|---|---|---|---|---|---|")
    for name in args.ways.split(","):
        way(name)
        step, amp = watched(base, batch, args.policy)
        for _ in range(6):
            step()
        rows: dict[int, list[tuple[float, float, float]]] = {0: [], 1: []}
        for i in range(args.steps):
            sync()
            if gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            w, c = time.perf_counter(), time.process_time()
            step()
            if gpu:
                end.record()
            sync()
            wall, cpu = (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3
            rows[i % 2].append((wall, cpu, start.elapsed_time(end) if gpu else float("nan")))
        med = {k: [statistics.median(r[j] for r in v) for j in range(3)] for k, v in rows.items()}
        n = len(amp._watch.records[-1]["layers"]) if amp._watch.records else 0
        say(f"| {name} | " + " | ".join(f"{x:.2f}" for x in med[0] + med[1]) + f" | {n} layers recorded |")
        amp.remove()
    way("default")
    step, amp = watched(base, batch, args.policy)
    for _ in range(6):
        step()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:  # one sampled step (the 7th call is step 6: sampled)
        step()
        sync()
    table = prof.key_averages()
    say("\n## torch.profiler, one sampled step, by self CPU time")
    say(table.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    if gpu:
        say("\n## by self device time")
        say(table.table(sort_by="self_cuda_time_total", row_limit=20, max_name_column_width=60))
    step()  # an unsampled step
    sync()
    pr = cProfile.Profile()
    pr.enable()
    step()  # sampled
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    say("\n## cProfile, one sampled step, by own time")
    say(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(35)
    say("\n## by cumulative time")
    say(s.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.getvalue())


if __name__ == "__main__":
    main()
