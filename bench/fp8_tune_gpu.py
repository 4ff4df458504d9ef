"""``unimp.tune(target="fp8")`` on HF Llama: the tuned FP8 policy against torchao's own layer filters (issue 26).

    python bench/fp8_tune_gpu.py --hidden 2048 --recipes tensorwise,rowwise --out tune2048.json   # H200
    python bench/fp8_tune_gpu.py --hidden 4096 --recipes tensorwise,rowwise --loss-steps 0 --out tune4096.json
    python bench/fp8_tune_gpu.py --smoke        # CPU, tiny Llama: every phase runs (timings meaningless)

One process, one GPU. The model: HF ``LlamaForCausalLM`` from its config, random init (seed 0), built once
and deep-copied for every variant (the same init everywhere): hidden 2048 is ``bench/hf_llama_gpu.py``'s model
(i5632, 8 layers, 16 heads), hidden 4096 ``bench/fp8_gpu.py``'s (i14336, 4 layers, 32 heads, 8 KV heads);
vocab 32000, seq 2048, batch 4, bf16 weights (``--weights``), fused AdamW.

1. tune: per recipe, ``unimp.tune`` of the preset (``fp8_tensorwise``, ``fp8_rowwise``, with the bench's
   weights dtype) on ``--tune-batches`` batches of the corpus below, ``speed=True`` (the FP8 GEMM
   microbenchmark decides which layers are slower in FP8 on this GPU); the tuned policy file is printed
   (its comments say which layers stay in bf16 and why), saved next to ``--out``, and a per-layer table
   sets it beside what torchao's two filters pick.
2. loss: ``--loss-steps`` (300) steps of bf16 native and of each tuned policy, the same init and the same
   batches (a sparse Markov chain over ``--corpus-vocab`` tokens: learnable, a fresh batch every step),
   the mean of the last 50 losses and its relative difference to bf16 (the issue: <= 1%). These compiled
   steps then join the timing pool as they are (their first step compiled them: no second compile).
3. time: every variant ``torch.compile``d (inductor) and alive, rounds in rotating order (``--rounds`` x
   ``--steps`` CUDA-event-timed steps each, median): ``bf16 native`` (autocast + compile), ``bf16 native2
   (A/A)`` (a second build: the noise of a ratio), and per recipe torchao by hand with its default filter
   (``fp8_gpu.native_filter``: every Linear with dims multiple of 16 except ``lm_head``, as torchtitan's
   default ``filter_fqns = ["output"]``), torchao with ``_auto_filter_for_recipe`` (what torchtitan's
   ``auto_filter_small_kn`` calls) and the unimp tuned policy; speed-up over bf16 native beside the A/A;
   peak memory per variant as if alone (its resident bytes, measured as it was built, plus its step's peak
   over what was allocated when the step began).
4. a markdown table, ``--out`` JSON (the policy files beside it), elapsed time per phase.

Budget (H200): compiles dominate (one per variant; the A/A hits dynamo's and inductor's caches); split the
recipes over two runs (``--recipes tensorwise`` / ``--recipes rowwise``) under a per-command time limit.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

import unimp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_gpu import _loss, llama, markov_corpus, native_filter, native_step, unimp_step  # the FP8 bench's builds
from torch_gpu import _ms, _timed  # the shared CUDA-event / wall-clock timers

PRESETS = {"tensorwise": "fp8_tensorwise", "rowwise": "fp8_rowwise"}
# the two benches' models, by hidden size (hf_llama_gpu.config, fp8_gpu's defaults)
MODELS = {2048: dict(inter=5632, layers=8, heads=16, kv=16), 4096: dict(inter=14336, layers=4, heads=32, kv=8),
          # a family no other bench uses: GQA with a narrow KV (4 of 24 heads) and a wide MLP (issue 31)
          3072: dict(inter=8192, layers=6, heads=24, kv=4)}
SMOKE = dict(hidden=64, inter=128, layers=2, heads=4, kv=2, vocab=128, seq=32, batch=2)
LOSS_TAIL = 50  # the final loss: the mean of the last 50 steps
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- torchao's two filters


def auto_filter(recipe: str) -> Callable[[nn.Module, str], bool]:
    """torchao's ``_auto_filter_for_recipe(recipe, filter_fqns)``, as torchtitan's ``auto_filter_small_kn`` calls it.

    torchao v0.17.0, ``torchao/float8/float8_linear_utils.py`` (exported by ``torchao/float8/__init__.py``)::

        def _auto_filter_for_recipe(recipe: Union[str, Float8LinearRecipeName], filter_fqns: List[str]
                                    ) -> Callable[[nn.Module, str], bool]

    tensorwise: keeps out ``K <= 4096 and N <= 1024``; rowwise: ``N <= 2048``, ``K <= 1024``, ``N <= 4096 and K <=
    2048`` (``N, K = weight.shape``); both: dims not multiples of 16 and any fqn containing a ``filter_fqns`` entry
    (here ``lm_head``, torchtitan's ``output``).
    """
    from torchao.float8 import _auto_filter_for_recipe

    return _auto_filter_for_recipe(recipe, filter_fqns=["lm_head"])


def _why(e: Exception, n: int = 300) -> str:
    """An exception on one line (it goes in a table cell)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:n]}"


def fp8_count(model: nn.Module) -> int:
    return sum(type(m).__name__ == "Float8Linear" for m in model.modules())


# ---------------------------------------------------------------- policies and tuning


def base_policy(recipe: str, weights: str, keep_out: list[str]) -> dict[str, Any]:
    """The recipe's preset with the bench's weights dtype (bf16 weights: no masters, as the native loops)."""
    policy: dict[str, Any] = {"extends": PRESETS[recipe], "layout": {"on_misaligned": "ignore"}}
    if weights == "bf16":
        policy.update(param_dtype="bfloat16", master_weights={"enabled": False})
    if keep_out:
        policy["overrides"] = [{"modules": keep_out, "fp8": False}]
    return policy


def tune(recipe: str, base: nn.Module, batches: list, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``unimp.tune`` of the recipe's preset on ``base`` (never changed: every run is on a copy)."""
    def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _loss(model(input_ids=batch[0]).logits, batch[1])

    linears = sum(isinstance(m, nn.Linear) for m in base.modules())
    speed = args.speed if args.speed in ("compiled", "eager", "gemm") else args.speed == "true"
    tuned = unimp.tune(base_policy(recipe, args.weights, args.keep_out), base, batches, loss_fn, target="fp8",
                       speed=speed, max_batches=len(batches), max_layers=max(64, linears),
                       max_loss_increase=args.max_loss_increase, min_speedup=args.min_speedup)
    rows = {r.path: r for r in tuned.sensitivity.rows}
    info = {"text": tuned.text, "kept": {k.layer.path: k.reason for k in tuned.kept},
            "lowered": [r.path for r in tuned.lowered], "loss": tuned.loss, "divergence": tuned.divergence,
            "output_divergence": tuned.output_divergence, "speed_note": tuned.sensitivity.speed_note,
            "rows": {p: {"shape": r.shape, "speedup": r.speedup, "divergence": r.divergence,
                         "output_divergence": r.output_divergence} for p, r in rows.items()}}
    return tuned, info


def _mark(fp8: bool) -> str:
    return "fp8" if fp8 else "bf16"


def layer_table(base: nn.Module, recipe: str, info: dict[str, Any], auto: Callable | None) -> str:
    """Per Linear: its FP8 GEMM speed-up and divergence as tune measured them, and who runs it in FP8."""
    lines = [f"| layer ({recipe}) | M x K x N | FP8 GEMM speed-up | divergence | output div. | torchao default | "
             f"torchao auto | unimp tuned |", "|---|---|---|---|---|---|---|---|"]
    for path, m in base.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        r = info["rows"].get(path, {})
        shape = "x".join(map(str, r["shape"])) if r.get("shape") else "-"
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        div = f"{r['divergence']:.3%}" if "divergence" in r else "-"
        out = f"{r['output_divergence']:.3%}" if r.get("output_divergence") is not None else "-"
        ours = ("fp8" if path in info["lowered"] else
                f"bf16: {info['kept'][path]}" if path in info["kept"] else "bf16 (not a candidate of the policy)")
        lines.append(f"| {path} | {shape} | {speed} | {div} | {out} | {_mark(native_filter(m, path))} | "
                     f"{_mark(auto(m, path)) if auto else 'n/a'} | {ours} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- variants


def builders(recipes: list[str], tuned: dict[str, Any], device: str, backend: str, args: argparse.Namespace,
             ao: str | None) -> dict[str, Callable[[nn.Module], Callable] | str]:
    """Label -> how to build the variant's compiled step from a model, or why it is skipped."""
    lr = args.lr
    out: dict[str, Callable[[nn.Module], Callable] | str] = {
        "bf16 native": lambda m: native_step(m, device, None, backend, lr),
        "bf16 native2 (A/A)": lambda m: native_step(m, device, None, backend, lr),
    }
    for r in recipes:
        out[f"{r} torchao default"] = ao or (lambda m, r=r: native_step(m, device, r, backend, lr))
        out[f"{r} torchao auto"] = ao or (lambda m, r=r: native_step(m, device, r, backend, lr, auto_filter(r)))
        out[f"{r} unimp tuned"] = (tuned[r] if isinstance(tuned[r], str) else
                                   lambda m, r=r: unimp_step(m, device, None, args.weights, backend, lr,
                                                             policy=tuned[r].policy))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny Llama (hidden 64, 2 layers, seq 32): every phase")
    ap.add_argument("--hidden", type=int, default=2048, choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the bench's model)")
    ap.add_argument("--recipes", default="tensorwise,rowwise", help="comma-separated: tensorwise, rowwise")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--weights", choices=("bf16", "fp32"), default="bf16",
                    help="bf16: bf16 parameters, no masters (fp8_gpu's default); fp32: fp32 parameters under "
                         "autocast (8 models alive: too much at hidden 4096)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--tune-batches", type=int, default=2, help="batches unimp.tune measures on")
    ap.add_argument("--max-loss-increase", type=float, default=0.01, help="unimp.tune's max_loss_increase")
    ap.add_argument("--min-speedup", type=float, default=1.0, help="unimp.tune's min_speedup")
    ap.add_argument("--speed", default="compiled", help="unimp.tune's speed: compiled (whole compiled steps decide), "
                                                        "eager, gemm (the per-shape microbenchmark), false")
    ap.add_argument("--keep-out", default="", help="comma-separated module globs kept out of FP8 by an override "
                                                   "before tuning (default: none: tune decides every Linear)")
    ap.add_argument("--policies", default=None, help="PREFIX: take the tuned policies from PREFIX.<recipe>.toml (a "
                                                    "tuned file written by an earlier run) instead of tuning")
    ap.add_argument("--loss-only", action="store_true", help="stop after the loss phase (no timing phase)")
    ap.add_argument("--loss-steps", type=int, default=300, help="loss steps of bf16 and each tuned policy (0: skip)")
    ap.add_argument("--corpus-vocab", type=int, default=2048, help="tokens of the Markov corpus (< vocab)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2, help="steps before timing (the first compiles)")
    ap.add_argument("--compile-backend", default=None, help="inductor on CUDA; aot_eager with --smoke")
    ap.add_argument("--out", default=None, help="write the results as JSON here (policy files beside it)")
    args = ap.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    bad = [r for r in recipes if r not in PRESETS]
    if bad or not recipes:
        ap.error(f"--recipes {args.recipes!r}: expected a comma-separated subset of {', '.join(PRESETS)}")
    args.keep_out = [g for g in args.keep_out.split(",") if g]
    shape = dict(hidden=args.hidden, **MODELS[args.hidden], vocab=args.vocab, seq=args.seq, batch=args.batch)
    if args.layers:
        shape["layers"] = args.layers
    if args.smoke:
        shape = dict(SMOKE)
        args.corpus_vocab = min(args.corpus_vocab, 64)
        for k, v in dict(loss_steps=60, rounds=2, steps=2, warmup=1).items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    if not 0 < args.corpus_vocab <= shape["vocab"]:
        ap.error(f"--corpus-vocab {args.corpus_vocab}: expected 1..vocab ({shape['vocab']})")
    if args.loss_steps and args.loss_steps < LOSS_TAIL:
        ap.error(f"--loss-steps {args.loss_steps}: expected 0 (skip) or >= {LOSS_TAIL} (the final loss is the mean "
                 f"of the last {LOSS_TAIL})")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    backend = args.compile_backend or ("aot_eager" if device == "cpu" else "inductor")
    # one cache entry per distinct FP8 layout of LlamaForCausalLM.forward: past the limit dynamo runs eager silently
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 512)
    elapsed: dict[str, float] = {}

    try:
        import torchao

        ao_version, ao_skip = torchao.__version__, None
    except Exception as e:  # the native FP8 variants need torchao; unimp's FP8 too (it says so itself)
        ao_version, ao_skip = None, f"skipped: torchao does not import ({_why(e, 120)})"
    env = {"torch": torch.__version__, "torchao": ao_version, "transformers": __import__("transformers").__version__,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "compile_backend": backend}
    say(f"{env}")
    say(f"model: HF Llama {shape}, {args.weights} weights; recipes {recipes}")
    result: dict[str, Any] = {"env": env, "args": vars(args), "shape": shape}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every phase: a run cut short by a time limit keeps what it measured
        result["elapsed_s"] = elapsed
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    # ---- data and the one init every variant copies
    t = time.perf_counter()
    n_loss, n_tune = args.loss_steps, args.tune_batches
    corpus, floor = markov_corpus(args.corpus_vocab, shape["seq"], shape["batch"], batches=n_loss + n_tune)
    corpus = corpus.to(device)
    pairs = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in corpus]
    loss_data, tune_data = pairs[:n_loss], pairs[n_loss:]  # tune measures on batches training never sees
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    wdtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # init on the device: a CPU init of a 1B model takes longer than its compile
        base = llama(shape["hidden"], shape["inter"], shape["layers"], shape["heads"], shape["kv"], shape["vocab"],
                     shape["seq"]).to(dtype=wdtype)
    elapsed["setup"] = time.perf_counter() - t
    say(f"phase setup: corpus ({n_loss + n_tune} batches, entropy floor {floor:.3f} nats) and model "
        f"({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters) in {elapsed['setup']:.1f}s")

    # ---- phase 1: tune
    t = time.perf_counter()
    tuned: dict[str, Any] = {}
    result["tune"] = {}
    base.eval()
    for r in recipes:
        tr = time.perf_counter()
        if args.policies:
            path = f"{args.policies}.{r}.toml"
            tuned[r] = SimpleNamespace(policy=unimp.load(path), text=Path(path).read_text())
            result["tune"][r] = {"policy_file": path, "text": tuned[r].text}
            say(f"tune {r}: the tuned policy of {path} (tuned_on {tuned[r].policy.tuned_on!r})")
            continue
        try:
            tuned[r], info = tune(r, base, tune_data, args)
        except Exception as e:  # e.g. no torchao on this machine: unimp says why; the bf16 variants still run
            tuned[r] = f"skipped: unimp.tune failed ({_why(e)})"
            result["tune"][r] = {"error": tuned[r]}
            say(f"tune {r}: {tuned[r]}")
            continue
        auto = None
        if ao_skip is None:
            try:
                auto = auto_filter(r)
            except Exception as e:
                say(f"torchao auto filter for {r}: {_why(e)}")
        info["elapsed_s"] = time.perf_counter() - tr
        info["layer_table"] = layer_table(base, r, info, auto)
        result["tune"][r] = info
        say(f"tune {r}: {len(info['lowered'])} layers in FP8, {len(info['kept'])} kept in bf16 "
            f"({info['elapsed_s']:.1f}s)\n\n{tuned[r]}\n\n--- tuned policy file ({r}) ---\n{info['text']}\n"
            f"--- per layer ({r}) ---\n{info['layer_table']}\n")
        if args.out:
            p = Path(args.out).with_suffix(f".{r}.toml")
            tuned[r].write(p)
            info["policy_file"] = str(p)
    base.train()
    elapsed["tune"] = time.perf_counter() - t
    say(f"phase tune: {elapsed['tune']:.1f}s")
    save()

    # ---- phase 2: loss (its variants' first step compiles them; they then join the timing pool)
    makers = builders(recipes, tuned, device, backend, args, ao_skip)
    runs: dict[str, Callable] = {}
    info_v: dict[str, dict[str, Any]] = {}

    def build(label: str) -> Callable | None:
        make = makers[label]
        if isinstance(make, str):
            info_v[label] = {"skipped": make}
            say(f"{label}: {make}")
            return None
        before = _allocated(device)
        tb = time.perf_counter()
        try:
            model = copy.deepcopy(base)
            step = make(model)
        except Exception as e:  # torchao refuses this recipe here (e.g. its FP8 on CPU): say why, go on
            info_v[label] = {"skipped": f"skipped: {_why(e)}"}
            say(f"{label}: {info_v[label]['skipped']}")
            return None
        info_v[label] = {"fp8_layers": fp8_count(model), "before": before, "t0": tb}
        return step

    def built(label: str) -> None:  # after its first steps: what the variant holds, how long it took
        _sync(device)
        v = info_v[label]
        v["resident_gib"] = (_allocated(device) - v.pop("before")) / 2**30 if device == "cuda" else None
        v["build_compile_s"] = time.perf_counter() - v.pop("t0")

    t = time.perf_counter()
    loss_labels = ["bf16 native"] + [f"{r} unimp tuned" for r in recipes]
    losses: dict[str, list[float]] = {}
    if n_loss:
        for label in loss_labels:
            step = build(label)
            if step is None:
                continue
            try:
                out = [step(bx, by).detach() for bx, by in loss_data]
            except Exception as e:  # e.g. torchao's FP8 does not run on this device: skip the variant, go on
                info_v[label] = {"skipped": f"skipped: {_why(e)}"}
                say(f"{label}: {info_v[label]['skipped']}")
                continue
            losses[label] = [float(v) for v in torch.stack(out).tolist()]  # one sync at the end
            built(label)
            runs[label] = _timed(step, x, y, device)
            every = max(n_loss // 6, 1)
            say(f"loss {label}: " + " ".join(f"{losses[label][i]:.3f}" for i in range(0, n_loss, every))
                + f" | last {losses[label][-1]:.4f} ({info_v[label]['build_compile_s']:.1f}s with the compile, "
                  f"{info_v[label]['fp8_layers']} FP8 layers)")
        tail = {k: statistics.fmean(v[-LOSS_TAIL:]) for k, v in losses.items()}
        ref = tail.get("bf16 native")
        result["loss"] = {"steps": n_loss, "lr": args.lr, "corpus_vocab": args.corpus_vocab, "entropy_floor": floor,
                          "losses": losses, f"mean_last{LOSS_TAIL}": tail,
                          "rel_diff_vs_bf16": {k: (v - ref) / ref for k, v in tail.items()
                                               if ref and k != "bf16 native"}}
    elapsed["loss"] = time.perf_counter() - t
    say(f"phase loss: {elapsed['loss']:.1f}s")
    save()
    if args.loss_only:
        return result

    # ---- phase 3: the other variants, then the timed rounds
    t = time.perf_counter()
    for label in makers:
        if label in runs or "skipped" in info_v.get(label, {}):
            continue
        step = build(label)
        if step is None:
            continue
        try:
            for _ in range(args.warmup):  # the first compiles
                step(x, y)
        except Exception as e:
            info_v[label] = {"skipped": f"skipped: {_why(e)}"}
            say(f"{label}: {info_v[label]['skipped']}")
            continue
        built(label)
        runs[label] = _timed(step, x, y, device)
        say(f"built + compiled + {args.warmup} warm-up steps: {label} ({info_v[label]['build_compile_s']:.1f}s, "
            f"{info_v[label]['fp8_layers']} FP8 layers)")
    elapsed["build"] = time.perf_counter() - t
    say(f"phase build + compile: {elapsed['build']:.1f}s")

    t = time.perf_counter()
    labels = list(runs)
    samples: dict[str, list[float]] = {k: [] for k in labels}
    transient: dict[str, int] = dict.fromkeys(labels, 0)
    for r in range(args.rounds):  # rotating order: each variant sees the same drift
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            start = _allocated(device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            samples[label] += _ms([runs[label]() for _ in range(args.steps)])
            if device == "cuda":
                transient[label] = max(transient[label], torch.cuda.max_memory_allocated() - start)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    elapsed["time"] = time.perf_counter() - t
    say(f"phase time: {args.rounds} rounds x {args.steps} steps of {len(labels)} variants in {elapsed['time']:.1f}s")
    for k in labels:
        v = info_v[k]
        v["ms"] = ms[k]
        v["peak_gib_alone"] = v["resident_gib"] + transient[k] / 2**30 if device == "cuda" else None
    result["speed"] = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "variants": info_v}
    elapsed["total"] = time.perf_counter() - T0

    print("\n" + report(result, recipes), flush=True)
    say(f"elapsed per phase: {', '.join(f'{k} {v:.1f}s' for k, v in elapsed.items())}")
    save()
    if args.out:
        say(f"wrote {args.out}")
    return result


def report(result: dict[str, Any], recipes: list[str]) -> str:
    """The markdown tables: speed per recipe (with the A/A), the verdicts, the losses."""
    v = result["speed"]["variants"]
    base = v.get("bf16 native", {}).get("ms")
    aa = v.get("bf16 native2 (A/A)", {}).get("ms")
    s = result["shape"]
    lines = [f"HF Llama h{s['hidden']} i{s['inter']} L{s['layers']} T{s['seq']} b{s['batch']}, "
             f"{result['args']['weights']} weights, {result['env']['compile_backend']}, median of "
             f"{result['speed']['rounds']} x {result['speed']['steps']} steps, rotating order, all alive",
             "", "| variant | FP8 layers | ms / step | speed-up vs bf16 native | vs bf16 native2 (A/A) | "
                 "peak GiB (alone) | build + compile s |", "|---|---|---|---|---|---|---|"]
    for label, d in v.items():
        if "skipped" in d:
            lines.append(f"| {label} | - | - | {d['skipped']} | - | - | - |")
            continue
        up = f"{base / d['ms']:.3f}x" if base else "n/a"
        up2 = f"{aa / d['ms']:.3f}x" if aa else "n/a"
        pk = f"{d['peak_gib_alone']:.2f}" if d.get("peak_gib_alone") is not None else "n/a"
        lines.append(f"| {label} | {d['fp8_layers']} | {d['ms']:.2f} | {up} | {up2} | {pk} | "
                     f"{d['build_compile_s']:.1f} |")
    if base and aa:
        lines += ["", f"A/A: bf16 native / bf16 native2 = {base / aa:.3f} (the noise of every ratio above)"]
    verdicts = {}
    for r in recipes:
        ours = v.get(f"{r} unimp tuned", {}).get("ms")
        theirs = [v.get(f"{r} torchao {f}", {}).get("ms") for f in ("default", "auto")]
        theirs = [m for m in theirs if m]
        if ours and theirs:
            best = min(theirs)
            verdicts[r] = best / ours
            lines.append(f"{r}: unimp tuned vs the better torchao filter: {best / ours:.3f}x "
                         f"({'at least as fast' if ours <= best else 'slower'}; >= 1 is the issue's bar, "
                         f"within the A/A noise counts as even)")
    result["speed"]["tuned_vs_best_torchao"] = verdicts
    loss = result.get("loss")
    if loss:
        tail = loss[f"mean_last{LOSS_TAIL}"]
        lines += ["", f"| loss, {loss['steps']} steps (same init, same batches) | mean of the last {LOSS_TAIL} | "
                      f"relative to bf16 | <= 1% |", "|---|---|---|---|"]
        for k, m in tail.items():
            d = loss["rel_diff_vs_bf16"].get(k)
            lines.append(f"| {k} | {m:.4f} | " + ("-" if d is None else f"{d:+.3%}") + " | "
                         + ("-" if d is None else ("yes" if abs(d) <= 0.01 else "NO")) + " |")
        lines.append(f"corpus entropy floor {loss['entropy_floor']:.3f} nats")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
