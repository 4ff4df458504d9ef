"""A keras_hub causal LM on Keras-on-JAX: unimp ``mixed_bf16`` vs Keras' own ``mixed_bfloat16``: step ms, peak memory.

    KERAS_BACKEND=jax python bench/keras_hub_gpu.py --out DIR   # H200: Gemma-style h2048 L8, seq 1024, batch 8
    KERAS_BACKEND=jax JAX_PLATFORMS=cpu python bench/keras_hub_gpu.py --smoke   # tiny shapes on CPU (< 2 min)

Variants, each a ``keras_hub.models.GemmaCausalLM`` (random init, seed 0, no downloads) compiled with Adam and
trained with ``model.train_on_batch`` (Keras' own jitted JAX train step, as ``fit`` runs it):

- ``keras mixed_bfloat16``: Keras' own policy, set by hand (``keras.config.set_dtype_policy("mixed_bfloat16")``
  while the model is built);
- ``keras mixed_bfloat16 (A/A)``: a second build of the same, the control: its ratio to the first is the noise;
- ``unimp mixed_bf16``: built in float32, then ``amp = unimp.apply("mixed_bf16", model, Adam)`` and compiled
  with ``amp.optimizer`` (norms stay float32 by the preset's design: not the same dtypes as Keras' own);
- ``keras twin``: Keras' own ``mixed_bfloat16`` given unimp's dtypes by hand — built under ``mixed_bfloat16``,
  then ``layer.dtype_policy = "float32"`` on the layers ``mixed_bf16`` runs in float32 (the token embedding,
  whose float32 output makes the residual stream float32; the decoder blocks, which carry that stream; every
  RMSNorm; the attention softmax): ``unimp / twin`` is the mechanism's cost, ``twin / keras`` the preset's
  dtype choice.

``--hlo``: each peak subprocess also dumps XLA's optimised HLO of the train step (``--xla_dump_to``) and
reports the op counts (converts, fusions, GEMM custom-calls) and XLA's buffer-assignment totals, per variant
(the HLO diff against the twin).

Time: all variants alive in one process, rounds in rotating order, ``--block`` steps per variant per round,
median step ms (and the median of per-round ratios). Peak memory: each variant alone in a fresh subprocess
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``), ``peak_bytes_in_use`` of the device's ``memory_stats()`` after
warm-up and 3 steps (``n/a`` where the device keeps no stats: CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
# the peak-memory subprocesses need the device while this process holds its models: no 75% preallocation
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

VARIANTS = ("keras mixed_bfloat16", "keras mixed_bfloat16 (A/A)", "unimp mixed_bf16", "keras twin")
# the layers unimp's mixed_bf16 runs in float32 on a keras_hub Gemma (amp.report(); the twin sets them by hand)
FLOAT32_LAYERS = ("ReversibleEmbedding", "GemmaDecoderBlock", "RMSNormalization", "Softmax", "GemmaBackbone")


def config(smoke: bool) -> tuple[dict[str, int], int, int]:
    """(GemmaBackbone kwargs, batch, sequence length)."""
    if smoke:
        return dict(vocabulary_size=256, num_layers=2, num_query_heads=4, num_key_value_heads=1, hidden_dim=64,
                    intermediate_dim=128, head_dim=16), 2, 32
    return dict(vocabulary_size=32000, num_layers=8, num_query_heads=8, num_key_value_heads=8, hidden_dim=2048,
                intermediate_dim=16384, head_dim=256), 8, 1024


def data(smoke: bool) -> tuple[dict[str, Any], Any]:
    import numpy as np

    cfg, batch, seq = config(smoke)
    t = np.random.default_rng(1).integers(0, cfg["vocabulary_size"], (batch, seq + 1)).astype("int32")
    return {"token_ids": t[:, :-1], "padding_mask": np.ones((batch, seq), bool)}, t[:, 1:]


def build(name: str, smoke: bool) -> Any:
    """Variant ``name``: the model compiled for training (unimp's Amp kept alive on the model)."""
    import keras
    import keras_hub

    policy = "mixed_bfloat16" if name.startswith("keras") else "float32"
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        backbone = keras_hub.models.GemmaBackbone(**config(smoke)[0], dropout=0.0)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    finally:
        keras.config.set_dtype_policy("float32")
    if name == "keras twin":
        for layer in [backbone, *backbone._flatten_layers(include_self=False, recursive=True)]:
            if type(layer).__name__ in FLOAT32_LAYERS:
                layer.dtype_policy = "float32"
    optimizer = keras.optimizers.Adam(1e-4)
    if name.startswith("unimp"):
        import unimp

        amp = unimp.apply(name.split()[1], model, optimizer)
        optimizer, model._bench_amp = amp.optimizer, amp
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def step(model: Any, x: Any, y: Any) -> float:
    """One training step; returns when it is done (the loss comes back to the host)."""
    return float(model.train_on_batch(x, y, return_dict=True)["loss"])


def register_backend() -> None:
    """unimp-keras when installed; from the sources on PYTHONPATH otherwise (a dev checkout)."""
    import unimp

    if "keras" not in unimp.backends():
        from unimp_keras.backend import KerasBackend

        unimp.register_backend(KerasBackend)


def time_all(smoke: bool, warmup: int, rounds: int, block: int) -> dict[str, Any]:
    """Median step ms of each variant, all alive, rounds in rotating order; per-round ratios to the first."""
    x, y = data(smoke)
    models = {n: build(n, smoke) for n in VARIANTS}
    losses = {}
    for n, m in models.items():
        t = time.perf_counter()
        for _ in range(warmup):
            losses[n] = step(m, x, y)
        print(f"  warm-up {n}: {time.perf_counter() - t:.1f} s (compile included), loss {losses[n]:.4f}",
              flush=True)
    samples: dict[str, list[float]] = {n: [] for n in VARIANTS}
    per_round: dict[str, list[float]] = {n: [] for n in VARIANTS}
    for r in range(rounds):
        order = list(VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)])
        this: dict[str, list[float]] = {n: [] for n in VARIANTS}
        for n in order:
            for _ in range(block):
                t = time.perf_counter()
                step(models[n], x, y)
                this[n].append((time.perf_counter() - t) * 1e3)
            samples[n] += this[n]
        base = statistics.median(this[VARIANTS[0]])
        for n in VARIANTS:
            per_round[n].append(statistics.median(this[n]) / base)
    return {"ms": {n: statistics.median(v) for n, v in samples.items()},
            "round_ratio": {n: statistics.median(v) for n, v in per_round.items()},
            "warmup_loss": losses}


def peak(name: str, smoke: bool, warmup: int) -> dict[str, Any]:
    """Peak device memory of variant ``name`` alone in this process."""
    import jax

    x, y = data(smoke)
    model = build(name, smoke)
    for _ in range(warmup + 3):
        step(model, x, y)
    stats = jax.devices()[0].memory_stats() or {}
    params = sum(v.value.nbytes for v in model.variables)
    dtypes = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        dtypes[type(layer).__name__] = sorted({*dtypes.get(type(layer).__name__, ()),
                                               str(layer.dtype_policy.compute_dtype)})
    hlo = hlo_stats(os.environ["HLO_DIR"]) if os.environ.get("HLO_DIR") else None
    if "peak_bytes_in_use" not in stats:
        return {"peak_gib": None, "variables_gib": params / 2**30, "dtypes": dtypes, "hlo": hlo}
    return {"peak_gib": stats["peak_bytes_in_use"] / 2**30, "in_use_gib": stats["bytes_in_use"] / 2**30,
            "variables_gib": params / 2**30, "dtypes": dtypes, "hlo": hlo}


def hlo_stats(folder: str) -> dict[str, Any]:
    """Op counts of the largest optimised HLO module XLA dumped (the train step) and its buffer totals."""
    import collections
    import glob
    import re

    mods = sorted(glob.glob(os.path.join(folder, "*after_optimizations.txt")), key=os.path.getsize)
    if not mods:
        return {"error": f"no HLO dumped in {folder}"}
    with open(mods[-1]) as f:
        text = f.read()
    ops = collections.Counter(re.findall(r"= [a-z0-9\[\],{}: ]*? ([a-z][a-z-]*)\(", text))
    gemms = len(re.findall(r'custom_call_target="__cublas\$gemm|custom_call_target="__cublas\$lt', text))
    converts_f32 = len(re.findall(r"= f32\[[^=]*? convert\(", text))
    converts_bf16 = len(re.findall(r"= bf16\[[^=]*? convert\(", text))
    out = {"module": os.path.basename(mods[-1]), "ops": dict(ops.most_common(12)), "gemm_custom_calls": gemms,
           "converts_to_f32": converts_f32, "converts_to_bf16": converts_bf16}
    ba = mods[-1].replace("after_optimizations.txt", "after_optimizations-buffer-assignment.txt")
    if os.path.exists(ba):
        with open(ba) as f:
            out["buffer_assignment"] = [ln.strip() for ln in f if re.search(r"(?i)total|allocation:", ln)][:12]
    return out


def table(result: dict[str, Any]) -> str:
    ms, rr, mem = result["ms"], result["round_ratio"], result["memory"]
    if not ms:  # --memory-only
        return "\n".join(f"| {n} | peak {mem.get(n, {}).get('peak_gib')} GiB |" for n in VARIANTS)
    base = ms[VARIANTS[0]]
    lines = ["| variant | step ms (median) | / keras mixed_bfloat16 | per-round ratio (median) | peak GiB |",
             "|---|---:|---:|---:|---:|"]
    for n in VARIANTS:
        pk = mem.get(n, {}).get("peak_gib")
        lines.append(f"| {n} | {ms[n]:.2f} | {ms[n] / base:.3f} | {rr[n]:.3f} | "
                     f"{'n/a' if pk is None else f'{pk:.2f}'} |")
    u, aa = ms["unimp mixed_bf16"] / base, ms["keras mixed_bfloat16 (A/A)"] / base
    tw = ms["keras twin"]
    lines.append(f"\nmechanism: unimp / keras twin (same dtypes) {ms['unimp mixed_bf16'] / tw:.3f}; dtype choice: "
                 f"twin / keras mixed_bfloat16 {tw / base:.3f}")
    lines.append(f"\nunimp / native {u:.3f} with the A/A control beside it {aa:.3f} "
                 f"({result['device']}, {result['rounds']} rounds x {result['block']} steps)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny config (CPU: checks the script runs)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--block", type=int, default=None, help="steps per variant per round")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--memory-only", action="store_true", help="only the peak-memory subprocesses (no timing)")
    ap.add_argument("--hlo", action="store_true", help="dump and summarise each variant's optimised HLO")
    ap.add_argument("--peak", default=None, help=argparse.SUPPRESS)  # one variant's peak (subprocess)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args(argv)
    if os.environ["KERAS_BACKEND"] != "jax":
        sys.exit(f"bench/keras_hub_gpu.py: KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}; run it with "
                 f"KERAS_BACKEND=jax (this benchmark measures Keras on JAX)")
    register_backend()
    warmup = 2 if args.smoke else 3
    if args.peak:
        print("PEAK " + json.dumps(peak(args.peak, args.smoke, warmup)), flush=True)
        return
    import jax
    import keras
    import keras_hub

    rounds, block = args.rounds or (3 if args.smoke else 8), args.block or (2 if args.smoke else 4)
    dev = jax.devices()[0]
    result: dict[str, Any] = {"jax": jax.__version__, "keras": keras.__version__, "keras_hub": keras_hub.__version__,
                              "device": getattr(dev, "device_kind", str(dev)), "config": config(args.smoke),
                              "rounds": rounds, "block": block}
    # the peaks first, each variant alone in a subprocess while this process holds no model (on an 80 GB card the
    # four timed models beside a peak subprocess run it out of memory)
    mem: dict[str, Any] = {}
    if not args.no_memory:
        env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        for i, n in enumerate(VARIANTS):
            cmd = [sys.executable, __file__, "--peak", n] + (["--smoke"] if args.smoke else [])
            if args.hlo:
                folder = os.path.join(tempfile.gettempdir(), f"keras_hub_hlo{i}")
                env = {**env, "HLO_DIR": folder, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                                                f" --xla_dump_to={folder} --xla_dump_hlo_as_text")}
            res = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
            line = [ln for ln in res.stdout.splitlines() if ln.startswith("PEAK ")]
            mem[n] = json.loads(line[-1][5:]) if line else {"peak_gib": None, "error": res.stderr[-2000:]}
            print(" ", n, {k: v for k, v in mem[n].items() if k != "error"}, flush=True)
    result["memory"] = mem
    if args.memory_only:
        result["ms"], result["round_ratio"] = {}, {}
    else:
        result.update(time_all(args.smoke, warmup, rounds, block))
        print({k: round(v, 2) for k, v in result["ms"].items()}, flush=True)
    print(table(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "keras_hub_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
