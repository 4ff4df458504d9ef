"""FP8 training on torch: bf16 + compile vs FP8 (torchao, by hand) vs FP8 through ``unimp.apply``.

    python bench/fp8_gpu.py --out fp8.json          # H200: HF Llama h4096 i14336 L4 T2048 b4, then the curve
    python bench/fp8_gpu.py --smoke                 # tiny shapes on CPU (torchao emulation): the script runs
    python bench/fp8_gpu.py --no-curve --layers 8   # the step-time table only, a deeper model
    python bench/fp8_gpu.py --curve-only            # the 300-step loss curves only

Step time: an HF ``LlamaForCausalLM`` from its config (random init), weights in bf16 (``--weights``),
AdamW (fused on CUDA), every variant ``torch.compile``d (mode default), all alive in one process
and timed in rotating order (CUDA events, median after warm-up):

- ``bf16 native``: ``torch.autocast(bfloat16)`` + compile, the baseline;
- ``fp8_tensorwise native`` / ``fp8_rowwise native``: what a torchao user writes,
  ``convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(r),
  module_filter_fn=...)`` (every Linear whose dims are multiples of 16 except ``lm_head``) + compile;
- ``fp8_tensorwise native2 (A/A)``: a second build of the native tensorwise variant (the noise);
- ``fp8_tensorwise unimp`` / ``fp8_rowwise unimp``: ``unimp.apply`` of the ``fp8_tensorwise`` /
  ``fp8_rowwise`` presets with the same weights dtype and ``lm_head`` kept out by an override
  (``fp8 = false``), then ``torch.compile(amp.model)``.

Curve (``--curve``, on by default): ``--curve-steps`` (300) AdamW steps of a small Llama (hidden 512,
4 layers) on a fixed synthetic corpus (a seeded sparse Markov chain: learnable, with a known entropy
floor), fp32 weights under bf16 autocast (``--curve-weights``), same init and data for bf16 /
FP8 tensorwise / FP8 rowwise through ``unimp.apply`` (``mixed_bf16``, ``fp8_tensorwise``, ``fp8_rowwise``)
and torchao's tensorwise recipe by hand (the reference for FP8's own effect); a fresh batch every step
(each step's loss is a held-out loss); losses every 25 steps and the FP8 / bf16 ratio of the final loss
(mean of the last 10 steps).
Prints timings as it goes; ``--out`` writes everything as JSON. Needs transformers and torchao
(``unimp-torch[fp8]``: torchao 0.18, built for torch 2.13; use the torchao release built for the
installed torch) and, for speed, a GPU with FP8 tensor cores (compute capability 8.9+). Budget on
one H200 with the defaults: 6 compiles of the 4-layer model (the A/A one hits inductor's cache)
plus 3 x 300 eager curve steps; ``--layers 2`` / ``--variants`` / ``--no-curve`` shorten it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import unimp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_gpu import _ms, _timed  # the shared CUDA-event / wall-clock timers

KEEP_OUT = ("lm_head",)  # layers left in bf16 by both the native filter and the unimp override
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- models and data


def llama(hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False)
    return LlamaForCausalLM(cfg)


def native_filter(module: nn.Module, fqn: str) -> bool:
    """The filter a torchao user writes: Linear layers with dims multiple of 16, lm_head kept out."""
    return (isinstance(module, nn.Linear) and fqn not in KEEP_OUT
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def unimp_policy(preset: str | None, weights: str) -> dict[str, Any]:
    """The preset with the bench's weights dtype (bf16 weights: no masters, as the native variants)."""
    base: dict[str, Any] = {"extends": preset or "mixed_bf16", "layout": {"on_misaligned": "ignore"},
                            "overrides": [{"modules": list(KEEP_OUT), "fp8": False}]} if preset else \
        {"extends": "mixed_bf16", "layout": {"on_misaligned": "ignore"}}
    if weights == "bf16":
        base.update(param_dtype="bfloat16", master_weights={"enabled": False})
    return base


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())


def _optimizer(model: nn.Module, device: str, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=device == "cuda")


def native_step(model: nn.Module, device: str, recipe: str | None, backend: str, lr: float = 1e-4,
                module_filter_fn: Callable[[nn.Module, str], bool] = native_filter) -> Callable:
    """bf16 autocast (+ torchao FP8 by hand when ``recipe``, on the layers ``module_filter_fn`` picks) + compile."""
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if device == "cpu":
            config = dataclasses.replace(config, emulate=True)  # no FP8 matmul on CPU: torchao emulates it
        convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn)
    opt = _optimizer(model, device, lr)
    forward = torch.compile(model, backend=backend) if backend != "none" else model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = forward(x).logits
        loss = _loss(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def unimp_step(model: nn.Module, device: str, preset: str | None, weights: str, backend: str,
               lr: float = 1e-4, policy: Any = None) -> Callable:
    """``unimp.apply`` of ``policy`` (default: the preset with the bench's weights dtype) + torch.compile."""
    amp = unimp.apply(policy if policy is not None else unimp_policy(preset, weights), model,
                      _optimizer(model, device, lr))
    forward = torch.compile(amp.model, backend=backend) if backend != "none" else amp.model

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = _loss(forward(x).logits, y)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        return loss

    step.amp = amp  # type: ignore[attr-defined]  (alive as long as the step)
    return step


# ---------------------------------------------------------------- step time


def variants(device: str, weights: str, backend: str) -> dict[str, Callable[[nn.Module], Callable]]:
    return {
        "bf16 native": lambda m: native_step(m, device, None, backend),
        "fp8_tensorwise native": lambda m: native_step(m, device, "tensorwise", backend),
        "fp8_tensorwise native2 (A/A)": lambda m: native_step(m, device, "tensorwise", backend),
        "fp8_tensorwise unimp": lambda m: unimp_step(m, device, "fp8_tensorwise", weights, backend),
        "fp8_rowwise native": lambda m: native_step(m, device, "rowwise", backend),
        "fp8_rowwise unimp": lambda m: unimp_step(m, device, "fp8_rowwise", weights, backend),
    }


def step_time(args: argparse.Namespace, device: str) -> dict[str, Any]:
    shape = dict(hidden=args.hidden, inter=args.intermediate, layers=args.layers, heads=args.heads, kv=args.kv_heads,
                 vocab=args.vocab, seq=args.seq)
    wdtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    torch.manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    only = [v for v in args.variants.split(",") if v] if args.variants else None
    runs: dict[str, Callable] = {}
    for label, make in variants(device, args.weights, args.compile_backend).items():
        if only and label not in only:
            continue
        t = time.perf_counter()
        torch.manual_seed(0)
        model = llama(**shape).to(device=device, dtype=wdtype)
        runs[label] = _timed(make(model), x, y, device)
        for _ in range(args.warmup):  # compiles here
            runs[label]()
        if device == "cuda":
            torch.cuda.synchronize()
        say(f"built + compiled + {args.warmup} warm-up steps: {label} ({time.perf_counter() - t:.1f}s)")
    samples: dict[str, list] = {k: [] for k in runs}
    labels = list(runs)
    block = 4 if device == "cuda" else 1
    t = time.perf_counter()
    for r in range(max(args.steps // block, 2)):  # rotating order: each variant sees the same drift
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            samples[label] += _ms([runs[label]() for _ in range(block)])
    ms = {k: statistics.median(v) for k, v in samples.items()}
    say(f"timed {len(samples[labels[0]])} steps per variant ({time.perf_counter() - t:.1f}s)")
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"shape": {**shape, "batch": args.batch, "weights": args.weights}, "ms": ms,
            "steps": len(samples[labels[0]]), "warmup": args.warmup, "peak_gib_all_alive": peak}


def ratios(ms: dict[str, float]) -> dict[str, float]:
    def r(a: str, b: str) -> float | None:
        return ms[a] / ms[b] if a in ms and b in ms else None

    out = {
        "bf16 / fp8_tensorwise native (speed-up)": r("bf16 native", "fp8_tensorwise native"),
        "bf16 / fp8_tensorwise unimp (speed-up)": r("bf16 native", "fp8_tensorwise unimp"),
        "bf16 / fp8_rowwise native (speed-up)": r("bf16 native", "fp8_rowwise native"),
        "bf16 / fp8_rowwise unimp (speed-up)": r("bf16 native", "fp8_rowwise unimp"),
        "fp8_tensorwise unimp / native": r("fp8_tensorwise unimp", "fp8_tensorwise native"),
        "fp8_rowwise unimp / native": r("fp8_rowwise unimp", "fp8_rowwise native"),
        "A/A: fp8_tensorwise native2 / native": r("fp8_tensorwise native2 (A/A)", "fp8_tensorwise native"),
    }
    return {k: v for k, v in out.items() if v is not None}


def step_table(res: dict[str, Any]) -> str:
    ms, base = res["ms"], res["ms"].get("bf16 native")
    lines = ["| variant | ms / step | bf16 native / this |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {base / v:.3f} |" if base else f"| {k} | {v:.2f} | n/a |" for k, v in ms.items()]
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in ratios(ms).items()]
    return "\n".join(lines)


# ---------------------------------------------------------------- loss curves


def markov_corpus(vocab: int, seq: int, batch: int, batches: int, seed: int = 0) -> tuple[torch.Tensor, float]:
    """``batches`` fixed batches of ``seq + 1`` tokens from a sparse Markov chain (4 successors per token,
    probabilities 0.55/0.25/0.15/0.05), and the chain's entropy rate in nats (the loss floor)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor([0.55, 0.25, 0.15, 0.05])
    succ = torch.stack([torch.randperm(vocab, generator=g)[:4] for _ in range(vocab)])
    tokens = torch.empty(batches * batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batches * batch,), generator=g)
    for t in range(seq):
        pick = torch.multinomial(probs.expand(batches * batch, 4), 1, generator=g).squeeze(1)
        tokens[:, t + 1] = succ[tokens[:, t], pick]
    floor = float(-(probs * probs.log()).sum())
    return tokens.view(batches, batch, seq + 1), floor


def curve(args: argparse.Namespace, device: str) -> dict[str, Any]:
    c = dict(hidden=args.curve_hidden, inter=args.curve_hidden * 3, layers=args.curve_layers, heads=8, kv=8,
             vocab=args.curve_vocab, seq=args.curve_seq)
    if args.smoke:
        c.update(heads=4, kv=4)
    # a fresh batch every step (no batch seen twice: the loss of a step is a held-out loss, and it
    # cannot go below the chain's entropy floor by memorising a few batches)
    data, floor = markov_corpus(args.curve_vocab, args.curve_seq, args.curve_batch, batches=args.curve_steps)
    data = data.to(device)
    wdtype = torch.bfloat16 if args.curve_weights == "bf16" else torch.float32
    out: dict[str, Any] = {"shape": {**c, "batch": args.curve_batch, "steps": args.curve_steps,
                                     "weights": args.curve_weights},
                           "entropy_floor": floor, "losses": {}}
    runs = {"bf16": "mixed_bf16", "fp8_tensorwise": "fp8_tensorwise", "fp8_tensorwise torchao by hand": "tensorwise",
            "fp8_rowwise": "fp8_rowwise"}
    for name, preset in runs.items():
        t = time.perf_counter()
        torch.manual_seed(0)
        model = llama(**c).to(device=device, dtype=wdtype)
        if name.endswith("by hand"):  # torchao's own recipe, written by hand: the reference for the FP8 curve
            step = native_step(model, device, preset, args.curve_backend, lr=args.curve_lr)
        else:
            step = unimp_step(model, device, None if preset == "mixed_bf16" else preset, args.curve_weights,
                              args.curve_backend, lr=args.curve_lr)
        losses = []
        for i in range(args.curve_steps):
            batch = data[i % data.shape[0]]
            losses.append(step(batch[:, :-1], batch[:, 1:]).detach())
        losses = [float(v) for v in torch.stack(losses).tolist()]  # one sync at the end
        out["losses"][name] = losses
        shown = " ".join(f"{losses[i]:.3f}" for i in range(0, len(losses), 25))
        say(f"curve {name}: every 25 steps {shown} | last {losses[-1]:.4f} ({time.perf_counter() - t:.1f}s)")
        if hasattr(step, "amp"):
            step.amp.remove()
    tail = {k: statistics.fmean(v[-10:]) for k, v in out["losses"].items()}
    out["final_mean_last10"] = tail
    out["ratio_to_bf16"] = {k: tail[k] / tail["bf16"] for k in tail if k != "bf16"}
    return out


def curve_table(res: dict[str, Any]) -> str:
    names = list(res["losses"])
    n = len(res["losses"][names[0]])
    lines = ["| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for i in [*range(0, n, 25), n - 1]:
        lines.append(f"| {i + 1} | " + " | ".join(f"{res['losses'][k][i]:.4f}" for k in names) + " |")
    lines += ["", f"entropy floor of the corpus: {res['entropy_floor']:.4f} nats",
              "final loss (mean of the last 10 steps): " + ", ".join(
                  f"{k} {v:.4f}" for k, v in res["final_mean_last10"].items()),
              "FP8 / bf16: " + ", ".join(f"{k} {v:.4f}" for k, v in res["ratio_to_bf16"].items())]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, a few steps (the script runs)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: bf16 parameters (no masters); fp32: fp32 parameters under autocast")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="", help="comma-separated labels to keep (default: all)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (inductor; aot_eager with "
                                                             "--smoke; none = eager)")
    ap.add_argument("--curve", action=argparse.BooleanOptionalAction, default=True, help="run the loss curves")
    ap.add_argument("--curve-only", action="store_true")
    ap.add_argument("--curve-steps", type=int, default=300)
    ap.add_argument("--curve-hidden", type=int, default=512)
    ap.add_argument("--curve-layers", type=int, default=4)
    ap.add_argument("--curve-seq", type=int, default=512)
    ap.add_argument("--curve-batch", type=int, default=16)
    ap.add_argument("--curve-vocab", type=int, default=256)
    ap.add_argument("--curve-lr", type=float, default=1e-3)
    ap.add_argument("--curve-weights", choices=("bf16", "fp32"), default="fp32",
                    help="fp32: fp32 parameters under bf16 autocast (mixed_bf16), the usual training setup")
    ap.add_argument("--curve-backend", default="none", help="torch.compile backend for the curves (none = eager)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        small = dict(layers=2, batch=2, seq=32, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128, steps=2,
                     warmup=1, curve_steps=30, curve_hidden=64, curve_layers=2, curve_seq=32, curve_batch=4,
                     curve_vocab=64)
        for k, v in small.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.compile_backend = args.compile_backend or ("aot_eager" if device == "cpu" else "inductor")
    import torchao  # fail early and clearly: FP8 needs it

    env = {"torch": torch.__version__, "torchao": torchao.__version__, "device":
           torch.cuda.get_device_name() if device == "cuda" else "cpu", "compile_backend": args.compile_backend}
    say(f"{env}")
    result: dict[str, Any] = {"env": env, "args": vars(args)}
    if not args.curve_only:
        result["step_time"] = st = step_time(args, device)
        result["step_time"]["ratios"] = ratios(st["ms"])
        print(f"\nHF Llama h{args.hidden} i{args.intermediate} L{args.layers} T{args.seq} b{args.batch}, "
              f"{args.weights} weights, median of {st['steps']} steps after {args.warmup} warm-up"
              + (f", peak {st['peak_gib_all_alive']:.1f} GiB with all variants alive" if st["peak_gib_all_alive"]
                 else "") + "\n")
        print(step_table(st), flush=True)
        torch._dynamo.reset()
    if args.curve or args.curve_only:
        result["curve"] = cv = curve(args, device)
        print("\n" + curve_table(cv), flush=True)
    say("done")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
