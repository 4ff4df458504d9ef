"""``mixed_bf16`` on a small HF GPT-2 on CPU vs the same step written by hand with torch autocast.

    python bench/torch_cpu_hf.py [--rounds 60] [--runs 3] [--profile] [--attribute]

The hand-written step gives every op the dtype ``mixed_bf16`` gives it on CPU, checked op by op
before timing (the aten ops each step computes, with their input dtypes, recorded below autocast by
a ``TorchDispatchMode``, must be the same sequence): ``torch.autocast("cpu", bfloat16)``; the
LayerNorms run in float32 by hand (autocast off, input cast); in GPT-2's GELU the ``pow`` runs in
float32 by hand and the rest of the formula as HF writes it (the policy moves ``pow``, not the
whole activation); the logits come back as autocast leaves them (``output_dtype = "unchanged"``); fused AdamW.
Three builds from the same weights live in one process: ``hand``, ``hand2`` (a second hand-written
build: the A/A control, i.e. the noise) and ``unimp``; each round runs one step of each, in a
rotating order, and the median over rounds is reported, forward only (``no_grad``) and full
training step (forward, backward, AdamW). ``--profile`` prints cProfile's view of the Python time
unimp adds per step (functions of ``unimp``/``unimp_torch``). ``--attribute`` adds a pair without the
``transcendental`` move (a policy extending ``mixed_bf16`` without it, and the hand-written step without
the float32 ``pow``): what unimp costs apart from its Python Autocast kernel for the moved ``pow``.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import math
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import unimp

BF16 = torch.bfloat16


def build(d: int, layers: int) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_positions=128, n_embd=d, n_layer=layers, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


class Float32:
    """A module's forward in float32 with autocast off (how a user keeps one layer in float32)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.forward = module.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.forward(x.float())


def pow_float32(x: torch.Tensor, exponent: float) -> torch.Tensor:
    with torch.autocast("cpu", enabled=False):
        return torch.pow(x.float(), exponent)


def gelu_pow_float32(input: torch.Tensor) -> torch.Tensor:
    """HF's ``NewGELUActivation.forward`` with its ``pow`` in float32 by hand (autocast off, input cast)."""
    return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * pow_float32(input, 3.0))))


def hand(model: torch.nn.Module, pow32: bool = True) -> tuple[Callable[[], float], Callable[[], None]]:
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.forward = Float32(m)
        elif type(m).__name__ == "NewGELUActivation" and pow32:
            m.forward = gelu_pow_float32
    opt = torch.optim.AdamW(model.parameters(), 1e-4, fused=True)

    def run() -> transformers.modeling_outputs.CausalLMOutputWithCrossAttentions:
        with torch.autocast("cpu", dtype=BF16):
            return model(**BATCH)  # logits not cast (the policy's output_dtype = "unchanged")

    def step() -> float:
        loss = run().loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def forward() -> None:
        with torch.no_grad():
            run()

    return step, forward


class OpDtypes(TorchDispatchMode):
    """Records each aten op computed (below autocast) with the dtypes of its tensor inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        self.ops.append((func.name(), tuple(str(a.dtype) for a in flat if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def op_dtypes(step: Callable[[], object]) -> list[tuple[str, tuple]]:
    with OpDtypes() as mode:
        step()
    return mode.ops


# mixed_bf16 without the transcendental move (for --attribute)
NO_TRANSCENDENTAL = {"name": "mixed_bf16_no_transcendental", "extends": "mixed_bf16", "ops": {"float32": [
    "softmax", "log_softmax", "layer_norm", "batch_norm", "group_norm", "rms_norm", "loss", "reduction"]}}


def ours(model: torch.nn.Module, policy: Any = "mixed_bf16") -> tuple[Callable[[], float], Callable[[], None]]:
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), 1e-4, fused=True))

    def step() -> float:
        loss = amp.model(**BATCH).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        return loss.item()

    def forward() -> None:
        with torch.no_grad():
            amp.model(**BATCH)

    return step, forward


def measure(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 3):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t = time.perf_counter()
            variants[n]()
            if r >= 3:  # warm-up rounds
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def main() -> None:
    global BATCH
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--attribute", action="store_true", help="add the pair without the transcendental move")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    BATCH = {"input_ids": ids, "labels": ids}
    base = build(args.d, args.layers)
    builds = {"hand": hand(copy.deepcopy(base)), "hand2": hand(copy.deepcopy(base)), "unimp": ours(copy.deepcopy(base))}
    if args.attribute:
        builds.update(hand_nt=hand(copy.deepcopy(base), pow32=False),
                      unimp_nt=ours(copy.deepcopy(base), NO_TRANSCENDENTAL))
    seen = {n: op_dtypes(builds[n][1]) for n in builds}
    assert seen["hand"] == seen["unimp"], "the hand-written forward does not give every op unimp's dtypes"
    assert not args.attribute or seen["hand_nt"] == seen["unimp_nt"] != seen["unimp"], "the pair without the move"
    first = {n: b[0]() for n, b in builds.items()}
    assert first["hand"] == first["unimp"] == first["hand2"], first  # same per-op dtypes: same loss
    assert not args.attribute or first["hand_nt"] == first["unimp_nt"], first
    print(f"GPT-2 d={args.d} layers={args.layers} batch={args.batch}x{args.seq}, torch {torch.__version__}, "
          f"1 thread; the same {len(seen['hand'])} aten ops with the same input dtypes per forward; "
          f"first loss equal in all builds ({first['unimp']:.6f})")
    extra = " without the transcendental move: hand ms | unimp ms | unimp/hand |" if args.attribute else ""
    print("| run | what | hand ms | hand2 ms | unimp ms | unimp/hand | A/A hand2/hand |" + extra)
    print("|---|---|---|---|---|---|---|" + ("---|---|---|" if args.attribute else ""))
    for run in range(args.runs):
        for what, i in (("forward", 1), ("step", 0)):
            ms = measure({n: b[i] for n, b in builds.items()}, args.rounds)
            nt = (f" {ms['hand_nt']:.3f} | {ms['unimp_nt']:.3f} | {ms['unimp_nt'] / ms['hand_nt']:.3f} |"
                  if args.attribute else "")
            print(f"| {run + 1} | {what} | {ms['hand']:.3f} | {ms['hand2']:.3f} | {ms['unimp']:.3f} | "
                  f"{ms['unimp'] / ms['hand']:.3f} | {ms['hand2'] / ms['hand']:.3f} |" + nt, flush=True)
    if args.profile:
        profile(builds, args.rounds)


def profile(builds: dict, rounds: int) -> None:
    """CPU time (``time.process_time``: less sensitive to a shared machine than wall time) per
    forward and per step, hand vs unimp, and unimp's own Python functions (self / cumulative)."""
    for what, i in (("forward", 1), ("step", 0)):
        for name in ("hand", "unimp"):
            t = time.process_time()
            for _ in range(rounds):
                builds[name][i]()
            print(f"\n{what} {name}: {(time.process_time() - t) / rounds * 1e6:.0f} us CPU time per call")
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        for _ in range(rounds):
            builds["unimp"][i]()
        prof.disable()
        rows = [(k, v) for k, v in pstats.Stats(prof).stats.items() if "unimp" in k[0]]
        rows.sort(key=lambda kv: -kv[1][2])
        print(f"unimp's functions under cProfile ({what}; profiled times are inflated by the profiler):")
        for (file, line, fn), (_, nc, tt, ct, _) in rows[:12]:
            print(f"  {tt / rounds * 1e6:8.1f} us self {ct / rounds * 1e6:9.1f} us cum "
                  f"{nc / rounds:5.1f} calls  {file.split('/unimp')[-1]}:{line} {fn}")

BATCH: dict[str, torch.Tensor] = {}

if __name__ == "__main__":
    main()
