"""HF Llama through unimp vs the loops HF users write by hand: step time and peak memory.

    python bench/hf_llama_gpu.py --out DIR          # H200: LlamaForCausalLM h2048 i5632 L8, seq 2048, batch 4
    python bench/hf_llama_gpu.py --smoke            # tiny shapes on CPU (checks the script runs)

Native loops, as HF users write them (no loop shaped to unimp):

- ``autocast`` (for ``mixed_bf16``)::

      with torch.autocast("cuda", torch.bfloat16):
          out = model(input_ids=ids)
      loss = F.cross_entropy(out.logits.float().view(-1, V), labels.view(-1))
      loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)      # fused AdamW

- ``o2`` (for ``pure_bf16``): apex-O2 by hand: ``model.bfloat16()``, fp32 master copies held by a fused
  AdamW, grads copied up after backward, masters copied down after the step, autocast forward.

The unimp side is the same code with ``amp = unimp.apply(policy, model, opt)``, ``amp.model`` in place of
the autocast block, ``amp.backward(loss)`` and ``amp.optimizer.step()``.

Time: every variant alive in one process, rounds in rotating order, CUDA events, median of the steps;
each ratio has an A/A control (a second native build of the same loop) next to it. Peak memory: each
variant alone in a fresh subprocess (nothing else alive, no compile cache of other variants), after
warm-up, ``torch.cuda.max_memory_allocated`` over 3 steps. ``--attribute`` adds, per variant, the bytes
autograd saved for backward by dtype (what makes a peak differ).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import unimp


def config(smoke: bool) -> tuple[Any, int, int]:
    from transformers import LlamaConfig

    if smoke:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=128)
        batch, seq = 2, 32
    else:
        cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=16, vocab_size=32000)
        batch, seq = 4, 2048
    return LlamaConfig(**cfg, max_position_embeddings=seq, use_cache=False), batch, seq


def build(smoke: bool, device: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config(smoke)[0]).to(device)


def data(smoke: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    cfg, batch, seq = config(smoke)
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g).to(device)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def autocast_loop(model: torch.nn.Module, device: str, compiled: bool) -> Callable:
    """The loop HF users write: autocast around the forward, fp32 cross-entropy, fused AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    fwd = torch.compile(model) if compiled else model

    def step(ids: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fwd(input_ids=ids)
        loss = _ce(out.logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def o2_loop(model: torch.nn.Module, device: str, compiled: bool) -> Callable:
    """apex-O2 written by hand: bf16 params, fp32 masters in the optimizer, autocast forward."""
    params = list(model.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in params]
    model.bfloat16()
    opt = torch.optim.AdamW(masters, lr=1e-4, fused=device == "cuda")
    fwd = torch.compile(model) if compiled else model

    def step(ids: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            out = fwd(input_ids=ids)
        loss = _ce(out.logits, labels)
        loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch._foreach_copy_([p.data for p in params], masters)

    return step


def unimp_loop(policy: str, model: torch.nn.Module, device: str, compiled: bool) -> Callable:
    """The same user code through unimp."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    amp = unimp.apply(policy, model, opt)
    fwd = torch.compile(amp.model) if compiled else amp.model

    def step(ids: torch.Tensor, labels: torch.Tensor) -> None:
        out = fwd(input_ids=ids)
        amp.backward(_ce(out.logits, labels))
        amp.optimizer.step()
        amp.optimizer.zero_grad(set_to_none=True)

    step.amp = amp  # type: ignore[attr-defined]  (alive as long as the step)
    return step


# attribution variants: the preset with one policy choice changed to what the hand-written loop does
OUT_F32 = {"extends": "mixed_bf16", "output_dtype": "float32"}  # outputs cast to float32 (native returns bf16 logits)
NORMS_BF16 = {"extends": "pure_bf16", "overrides": [{"types": ["LlamaRMSNorm"], "param_dtype": "bfloat16"}]}

VARIANTS: dict[str, Callable[[torch.nn.Module, str], Callable]] = {
    "native": lambda m, d: autocast_loop(m, d, False),
    "native2 (A/A)": lambda m, d: autocast_loop(m, d, False),
    "unimp mixed_bf16": lambda m, d: unimp_loop("mixed_bf16", m, d, False),
    "unimp mixed_bf16, outputs float32": lambda m, d: unimp_loop(OUT_F32, m, d, False),
    "native+compile": lambda m, d: autocast_loop(m, d, True),
    "native2+compile (A/A)": lambda m, d: autocast_loop(m, d, True),
    "unimp mixed_bf16+compile": lambda m, d: unimp_loop("mixed_bf16", m, d, True),
    "unimp mixed_bf16, outputs float32+compile": lambda m, d: unimp_loop(OUT_F32, m, d, True),
    "o2": lambda m, d: o2_loop(m, d, False),
    "o2b (A/A)": lambda m, d: o2_loop(m, d, False),
    "unimp pure_bf16": lambda m, d: unimp_loop("pure_bf16", m, d, False),
    "unimp pure_bf16, bf16 norm weights": lambda m, d: unimp_loop(NORMS_BF16, m, d, False),
}
GROUPS = {"eager": ("native", "native2 (A/A)", "unimp mixed_bf16", "unimp mixed_bf16, outputs float32"),
          "compiled": ("native+compile", "native2+compile (A/A)", "unimp mixed_bf16+compile"),
          "o2": ("o2", "o2b (A/A)", "unimp pure_bf16", "unimp pure_bf16, bf16 norm weights")}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_group(names: tuple[str, ...], smoke: bool, device: str, warmup: int, rounds: int,
               block: int) -> dict[str, float]:
    """Median step ms of each variant, all alive, rounds in rotating order."""
    ids, labels = data(smoke, device)
    steps = {n: VARIANTS[n](build(smoke, device), device) for n in names}
    for s in steps.values():
        for _ in range(warmup):
            s(ids, labels)
    _sync(device)
    samples: dict[str, list[float]] = {n: [] for n in names}
    order = list(names)
    for r in range(rounds):
        for n in order[r % len(order):] + order[:r % len(order)]:
            if device == "cuda":
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(block)]
                for a, b in ev:
                    a.record()
                    steps[n](ids, labels)
                    b.record()
                torch.cuda.synchronize()
                samples[n] += [a.elapsed_time(b) for a, b in ev]
            else:
                import time

                for _ in range(block):
                    t = time.perf_counter()
                    steps[n](ids, labels)
                    samples[n].append((time.perf_counter() - t) * 1e3)
    return {n: statistics.median(v) for n, v in samples.items()}


def peak(name: str, smoke: bool, device: str, warmup: int, attribute: bool) -> dict[str, Any]:
    """Peak memory of variant ``name`` alone in this process."""
    ids, labels = data(smoke, device)
    step = VARIANTS[name](build(smoke, device), device)
    for _ in range(warmup):
        step(ids, labels)
    out: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step(ids, labels)
        torch.cuda.synchronize()
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["resident_gib"] = torch.cuda.memory_allocated() / 2**30
    if attribute:  # bytes autograd saves for backward, by dtype (one step, deduplicated by storage)
        seen: set[int] = set()
        by: Counter = Counter()
        shapes: Counter = Counter()

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                dtype = str(t.dtype).replace("torch.", "")
                by[dtype] += t.untyped_storage().nbytes()
                shapes[f"{dtype}{list(t.shape)}"] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step(ids, labels)
        out["saved_gib"] = {k: round(v / 2**30, 3) for k, v in sorted(by.items())}
        out["saved_top_mib"] = {k: round(v / 2**20, 1) for k, v in shapes.most_common(12)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--groups", default="eager,compiled,o2")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--attribute", action="store_true", help="saved-for-backward bytes by dtype per variant")
    ap.add_argument("--peak", default=None, help=argparse.SUPPRESS)  # one variant's peak (subprocess)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    warmup = 2 if args.smoke else 5
    if args.peak:
        print("PEAK " + json.dumps(peak(args.peak, args.smoke, device, warmup, args.attribute)), flush=True)
        return
    groups = [g for g in args.groups.split(",") if g]
    rounds = args.rounds or (3 if args.smoke else 12)
    block = 1 if args.smoke else 3
    result: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if
                              device == "cuda" else "cpu", "rounds": rounds, "block": block, "groups": {}}
    for g in groups:
        ms = time_group(GROUPS[g], args.smoke, device, warmup, rounds, block)
        print(g, {k: round(v, 2) for k, v in ms.items()}, flush=True)
        mem = {}
        for n in GROUPS[g]:
            cmd = [sys.executable, __file__, "--peak", n] + (["--smoke"] if args.smoke else []) + (
                ["--attribute"] if args.attribute else [])
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("PEAK ")]
            mem[n] = json.loads(line[-1][5:]) if line else {"error": res.stderr[-2000:]}
            print(" ", n, mem[n], flush=True)
        result["groups"][g] = {"ms": ms, "memory": mem}
        torch.cuda.empty_cache() if device == "cuda" else None
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "hf_llama_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)


def table(result: dict[str, Any]) -> str:
    lines = ["| group | variant | ms | / native of the group | peak GiB | saved for backward GiB |",
             "|---|---|---|---|---|---|"]
    for g, r in result["groups"].items():
        base = r["ms"][GROUPS[g][0]]
        for n, ms in r["ms"].items():
            m = r["memory"].get(n, {})
            pk = f"{m['peak_gib']:.2f}" if "peak_gib" in m else "n/a"
            lines.append(f"| {g} | {n} | {ms:.2f} | {ms / base:.3f} | {pk} | {m.get('saved_gib', '')} |")
    lines.append("")
    for r in result["groups"].values():
        for n, m in r["memory"].items():
            if "saved_top_mib" in m:
                lines.append(f"{n}: {m['saved_top_mib']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
