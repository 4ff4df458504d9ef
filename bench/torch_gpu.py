"""Training-step time and peak memory: hand-written native torch AMP vs ``unimp.apply``.

    python bench/torch_gpu.py            # H200: ResNet-50 b128 224^2 and a GPT block d2048 T2048 b8
    python bench/torch_gpu.py --smoke    # tiny shapes on CPU, to check the script runs
    python bench/torch_gpu.py --suite compiled   # torch.compile: torchvision ResNet-50 b128, HF Llama

The ``compiled`` suite times, interleaved and with every model alive: native autocast eager,
native + ``torch.compile``, a second native + compile build (the A/A control: the noise), unimp
eager, unimp + compile, and a custom-list policy eager and compiled (``custom_lowered_norms``:
``layer_norm`` lowered, so unimp's PolicyMode is active on every call; neither model has a
LayerNorm, so the numerics are mixed_bf16's and the ratio to native is the mechanism's cost).

For each policy the native step is what a careful user writes by hand with torch's own tools
(autocast, GradScaler, channels_last, explicit casts where the policy moves an op, fp32 master
copies); the unimp step is the same model through ``unimp.apply``. Median of >= 20 timed steps
after warm-up, CUDA events (no host sync inside the timed steps). Prints a markdown table and,
when $OUT is set, writes $OUT/torch_gpu.json. bench/torch_cpu.py reuses this file on CPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import unimp

# ---------------------------------------------------------------- models (no torchvision needed)


class Norm(nn.LayerNorm):
    """LayerNorm whose *native* variant casts by hand the way a policy asks (``mode``)."""

    mode: str | None = None  # None: as is | "float32": x.float() | "low": all args to bf16 (as autocast lowers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "float32":
            return super().forward(x.float())
        if self.mode == "low":
            with torch.autocast(x.device.type, enabled=False):
                low = torch.bfloat16
                return F.layer_norm(x.to(low), self.normalized_shape, self.weight.to(low), self.bias.to(low),
                                    self.eps)
        return super().forward(x)


class Block(nn.Module):
    """GPT-style pre-norm block: causal SDPA attention + GELU MLP."""

    def __init__(self, d: int, heads: int, norm: Callable[[int], nn.Module] | None = None) -> None:
        super().__init__()
        self.heads = heads
        norm = norm or Norm
        self.ln1, self.ln2 = norm(d), norm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50 v1.5 (``layers=(3, 4, 6, 3)``, ``base=64``); smaller settings for CPU."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, base, 7, 2, 3, bias=False), nn.BatchNorm2d(base), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], base
        for i, n in enumerate(layers):
            for j in range(n):
                blocks.append(Bottleneck(cin, base * 2**i, 2 if j == 0 and i > 0 else 1))
                cin = base * 2**i * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


# ---------------------------------------------------------------- policies and their native steps

CUSTOM = {"name": "custom_lowered_norms", "extends": "mixed_bf16",
          "ops": {"lower": ["matmul", "linear", "conv", "attention", "rnn", "layer_norm"]}}
POLICIES = {"fp32_strict": "fp32", "fp32": "fp32", "mixed_bf16": "mixed_bf16", "mixed_fp16": "mixed_fp16",
            "pure_bf16": "pure_bf16", "custom_lowered_norms": CUSTOM}


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):  # an HF ModelOutput: next-token loss on the logits
        out = out.logits
    out = out.float()
    if target.dtype == torch.long and target.dim() > 1:
        return F.cross_entropy(out.flatten(0, -2), target.flatten())
    return F.cross_entropy(out, target) if target.dtype == torch.long else F.mse_loss(out, target)


def native_step(name: str, model: nn.Module, device: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The hand-written torch AMP step for policy ``name`` (sets the model up as it must be)."""
    policy = unimp.load(POLICIES[name])
    conv = any(isinstance(m, nn.Conv2d) for m in model.modules())
    cl = policy.layout.channels_last and conv
    if cl:
        model.to(memory_format=torch.channels_last)
    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(policy.compute_dtype)
    # where the policy and torch's native list differ for LayerNorm on this device, cast by hand
    ln = policy.ops.category("layer_norm")
    mode = {("float32", "cpu"): "float32", ("lower", "cpu"): "low", ("lower", "cuda"): "low"}.get(
        (ln, device)) if low else None
    for m in model.modules():
        if isinstance(m, Norm):
            m.mode = mode  # this model's own hand-written casts
    masters: list[tuple[nn.Parameter, torch.Tensor]] = []
    if policy.param_dtype != "float32":
        for m in model.modules():
            if isinstance(m, nn.LayerNorm | nn.BatchNorm2d):
                continue
            for p in m.parameters(recurse=False):
                masters.append((p, p.detach().clone()))
                p.data = p.data.to(low)
    params = [mst for _, mst in masters] if masters else list(model.parameters())
    if masters:
        for _, mst in masters:
            mst.requires_grad_(True)
        params += [p for m in model.modules() if isinstance(m, nn.LayerNorm | nn.BatchNorm2d)
                   for p in m.parameters(recurse=False)]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(device) if policy.loss_scale.mode == "dynamic" else None

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device, dtype=low, enabled=low is not None):
            out = model(x)
        loss = _loss(out, y)
        (scaler.scale(loss) if scaler else loss).backward()
        if masters:
            for p, mst in masters:
                mst.grad = p.grad.float()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if masters:
            torch._foreach_copy_([p.data for p, _ in masters], [m for _, m in masters])
            for p, _ in masters:
                p.grad = None
        opt.zero_grad(set_to_none=True)

    return step


def unimp_step(name: str, model: nn.Module, compile_backend: str | None = None
               ) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    amp = unimp.apply(POLICIES[name], model, opt)
    forward = torch.compile(amp.model, backend=compile_backend) if compile_backend else amp.model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        amp.backward(_loss(forward(x), y))
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    return step, amp


# ---------------------------------------------------------------- timing


def _timed(step: Callable, x: torch.Tensor, y: torch.Tensor, device: str) -> Callable[[], float | Any]:
    if device == "cuda":
        def run() -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(x, y)
            end.record()
            return (start, end)
    else:
        def run() -> float:
            t = time.perf_counter()
            step(x, y)
            return (time.perf_counter() - t) * 1e3
    return run


def _ms(samples: list) -> list[float]:
    if samples and isinstance(samples[0], tuple):
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in samples]
    return samples


def measure(build: Callable[[], nn.Module], data: Callable[[], tuple], name: str, device: str,
            warmup: int, steps: int, interleave: bool) -> dict[str, Any]:
    """Median step ms and peak memory for native vs unimp under policy ``name``."""
    x, y = data()
    result: dict[str, Any] = {"policy": name}
    # both models alive, native and unimp alternating (the machine's load, clocks and caches hit
    # both alike): step by step on CPU, in blocks of steps in both orders on GPU
    torch.manual_seed(0)
    m1 = build().to(device)
    torch.manual_seed(0)
    m2 = build().to(device)
    nat = _timed(native_step(name, m1, device), x, y, device)
    ours_step, amp = unimp_step(name, m2)
    ours = _timed(ours_step, x, y, device)
    for _ in range(warmup):
        nat(), ours()
    block = 1 if interleave else max(steps // 6, 4)
    a: list = []
    b: list = []
    for r in range(max(steps // block, 2)):
        order = ((nat, a), (ours, b)) if r % 2 == 0 else ((ours, b), (nat, a))
        for fn, acc in order:
            acc += _ms([fn() for _ in range(block)])
    result.update(native_ms=statistics.median(a), unimp_ms=statistics.median(b))
    amp.remove()
    del m1, m2, nat, ours, ours_step, amp
    if interleave:
        return result
    # peak memory: a separate pass per variant
    for label in ("native", "unimp"):
        gc.collect()
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        model = build().to(device)
        if label == "native":
            run = _timed(native_step(name, model, device), x, y, device)
        else:
            s, _amp = unimp_step(name, model)  # the Amp stays alive while it runs
            run = _timed(s, x, y, device)
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _ms([run() for _ in range(3)])
        result[f"{label}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model, run
    return result


def workloads(smoke: bool, device: str) -> dict[str, tuple[Callable, Callable]]:
    dev = device
    if smoke:
        rn = (lambda: ResNet((1, 1, 1, 1), 8, 10), lambda: (torch.randn(4, 3, 32, 32, device=dev),
                                                           torch.randint(0, 10, (4,), device=dev)))
        gpt = (lambda: Block(64, 4), lambda: (torch.randn(2, 32, 64, device=dev), torch.randn(2, 32, 64, device=dev)))
    else:
        rn = (lambda: ResNet(), lambda: (torch.randn(128, 3, 224, 224, device=dev),
                                         torch.randint(0, 1000, (128,), device=dev)))
        gpt = (lambda: Block(2048, 16), lambda: (torch.randn(8, 2048, 2048, device=dev),
                                                 torch.randn(8, 2048, 2048, device=dev)))
    return {"resnet50": rn, "gpt_block": gpt}


def table(rows: list[dict[str, Any]], fp32: dict[str, float]) -> str:
    head = ("| model | policy | native ms | unimp ms | unimp/native | speed-up vs strict fp32 (unimp) | "
            "peak GiB native | peak GiB unimp |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        peak = (f"{r['native_peak_gib']:.2f} | {r['unimp_peak_gib']:.2f}" if "native_peak_gib" in r else "n/a | n/a")
        lines.append(f"| {r['model']} | {r['policy']} | {r['native_ms']:.2f} | {r['unimp_ms']:.2f} | "
                     f"{r['unimp_ms'] / r['native_ms']:.3f} | {fp32[r['model']] / r['unimp_ms']:.2f}x | {peak} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- torch.compile suite


def compiled_workloads(smoke: bool, device: str) -> dict[str, tuple[Callable, Callable]]:
    """torchvision's ResNet-50 (this file's when torchvision is missing) and HF LlamaForCausalLM."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = device
    try:
        from torchvision.models import resnet50
    except ImportError:  # same architecture, written here
        resnet50 = None
    if smoke:
        cfg = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=128)
        batch, seq = 2, 32
        rn = (lambda: ResNet((1, 1, 1, 1), 8, 10), lambda: (torch.randn(4, 3, 32, 32, device=dev),
                                                           torch.randint(0, 10, (4,), device=dev)))
    else:
        cfg = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=16, vocab_size=32000)
        batch, seq = 4, 2048
        rn = (lambda: resnet50() if resnet50 else ResNet(),
              lambda: (torch.randn(128, 3, 224, 224, device=dev), torch.randint(0, 1000, (128,), device=dev)))
    config = LlamaConfig(**cfg, max_position_embeddings=seq, use_cache=False)

    def ids() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), device=dev)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    return {"resnet50": rn, "hf_llama": (lambda: LlamaForCausalLM(config), ids)}


def _variants(compile_backend: str) -> dict[str, Callable[[nn.Module, str], Callable]]:
    def native(compiled: bool) -> Callable[[nn.Module, str], Callable]:
        def make(model: nn.Module, device: str) -> Callable:
            return native_step("mixed_bf16", torch.compile(model, backend=compile_backend) if compiled else model,
                               device)
        return make

    def ours(name: str, compiled: bool) -> Callable[[nn.Module, str], Callable]:
        def make(model: nn.Module, device: str) -> Callable:
            step, amp = unimp_step(name, model, compile_backend if compiled else None)
            step.amp = amp  # type: ignore[attr-defined]  (alive as long as the step)
            return step
        return make

    return {"native": native(False), "native+compile": native(True), "native2+compile (A/A)": native(True),
            "unimp": ours("mixed_bf16", False), "unimp+compile": ours("mixed_bf16", True),
            "custom": ours("custom_lowered_norms", False), "custom+compile": ours("custom_lowered_norms", True)}


def measure_variants(build: Callable[[], nn.Module], data: Callable[[], tuple], device: str, warmup: int,
                     steps: int, compile_backend: str, only: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Median step ms (all variants alive, rounds in rotating order) and peak GiB (cuda) per variant.

    ``only`` keeps just those variants alive (fewer graphs and allocations: a quieter comparison)."""
    x, y = data()
    variants = {k: v for k, v in _variants(compile_backend).items() if not only or k in only}
    runs = {}
    for label, make in variants.items():
        torch.manual_seed(0)
        runs[label] = _timed(make(build().to(device), device), x, y, device)
    for run in runs.values():  # compiles here
        for _ in range(warmup):
            run()
    block = 1 if device != "cuda" else 4
    samples: dict[str, list] = {k: [] for k in runs}
    labels = list(runs)
    for r in range(max(steps // block, 2)):
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            samples[label] += _ms([runs[label]() for _ in range(block)])
    out = {k: {"ms": statistics.median(v)} for k, v in samples.items()}
    del runs
    if device == "cuda":
        for label, make in variants.items():  # peak memory: one variant alive at a time
            torch._dynamo.reset()  # dynamo's caches hold the compiled variants' models (and their state) alive
            gc.collect()
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            run = _timed(make(build().to(device), device), x, y, device)
            for _ in range(warmup):
                run()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            _ms([run() for _ in range(3)])
            out[label]["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del run
    return out


def compiled_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| model | variant | ms | / native eager | / native+compile | peak GiB |", "|" + "---|" * 6]
    for model, res in results.items():
        nat, natc = res.get("native", {}).get("ms"), res.get("native+compile", {}).get("ms")
        for label, r in res.items():
            peak = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "n/a"
            rel = [f"{r['ms'] / b:.3f}" if b else "n/a" for b in (nat, natc)]
            lines.append(f"| {model} | {label} | {r['ms']:.2f} | {rel[0]} | {rel[1]} | {peak} |")
    lines += ["", "| model | unimp+compile / native+compile | A/A | unimp eager / unimp+compile | "
                  "custom / native | custom+compile / native+compile |", "|" + "---|" * 6]
    for model, res in results.items():
        ms = {k: v["ms"] for k, v in res.items()}

        def ratio(a: str, b: str, fmt: str = ".3f", ms: dict[str, float] = ms) -> str:
            return format(ms[a] / ms[b], fmt) + ("x" if fmt == ".2f" else "") if a in ms and b in ms else "n/a"
        lines.append(f"| {model} | {ratio('unimp+compile', 'native+compile')} | "
                     f"{ratio('native2+compile (A/A)', 'native+compile')} | "
                     f"{ratio('unimp', 'unimp+compile', '.2f')} | {ratio('custom', 'native')} | "
                     f"{ratio('custom+compile', 'native+compile')} |")
    return "\n".join(lines)


def compiled_main(args: argparse.Namespace, device: str) -> dict[str, Any]:
    steps = args.steps or (6 if args.smoke else 30)
    warmup = 2 if args.smoke else 5
    backend = args.compile_backend or ("aot_eager" if args.smoke else "inductor")
    results = {}
    for model_name, (build, data) in compiled_workloads(args.smoke, device).items():
        if model_name not in args.compiled_models.split(","):
            continue
        only = tuple(v for v in args.variants.split(",") if v) if args.variants else ()
        results[model_name] = measure_variants(build, data, device, warmup, steps, backend, only)
        print(model_name, {k: round(v["ms"], 2) for k, v in results[model_name].items()}, flush=True)
    print(f"\ntorch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"torch.compile backend {backend}, median of {steps} steps after {warmup} warm-up\n")
    print(compiled_table(results))
    return {"backend": backend, "steps": steps, "results": results}


def main(argv: list[str] | None = None, device: str | None = None, smoke_default: bool = False,
         out_name: str = "torch_gpu.json") -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", default=smoke_default, help="tiny shapes (CPU ok)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (>= 20)")
    ap.add_argument("--models", default="resnet50,gpt_block")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--suite", choices=("policies", "compiled", "all"), default="policies")
    ap.add_argument("--compiled-models", default="resnet50,hf_llama")
    ap.add_argument("--variants", default="", help="compiled suite: keep only these variants alive "
                    "(comma-separated labels, e.g. 'native+compile,native2+compile (A/A),unimp+compile')")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; "
                    "aot_eager with --smoke)")
    args = ap.parse_args(argv)
    device = device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    compiled = compiled_main(args, device) if args.suite in ("compiled", "all") else None
    if compiled is not None and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], out_name.replace(".json", "_compiled.json")), "w") as f:
            json.dump({"torch": torch.__version__, "device": device, **compiled}, f, indent=1)
    if args.suite == "compiled":
        return []
    steps = args.steps or (20 if args.smoke else 30)
    warmup = 3 if args.smoke else 5
    rows = []
    for model_name, (build, data) in workloads(args.smoke, device).items():
        if model_name not in args.models.split(","):
            continue
        for name in args.policies.split(","):
            strict = name == "fp32_strict"  # fp32 with TF32 off (torch's default lets cuDNN convs use TF32)
            if strict:
                torch.backends.cudnn.allow_tf32 = False
                torch.backends.cuda.matmul.allow_tf32 = False
            try:
                r = measure(build, data, name, device, warmup, steps, interleave=device != "cuda")
            finally:
                torch.backends.cudnn.allow_tf32 = True
                torch.backends.cuda.matmul.allow_tf32 = False
            r["model"] = model_name
            rows.append(r)
            print(f"{model_name:10s} {name:22s} native {r['native_ms']:8.2f} ms  unimp {r['unimp_ms']:8.2f} ms  "
                  f"ratio {r['unimp_ms'] / r['native_ms']:.3f}", flush=True)
    fp32 = {r["model"]: r["native_ms"] for r in rows if r["policy"] == "fp32"}
    fp32.update({r["model"]: r["native_ms"] for r in rows if r["policy"] == "fp32_strict"})  # no TF32 on CPU
    fp32 = {m: fp32.get(m, float("nan")) for m in {r["model"] for r in rows}}
    print(f"\ntorch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
          f"median of {steps} steps after {warmup} warm-up\n")
    print(table(rows, fp32))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], out_name), "w") as f:
            json.dump({"torch": torch.__version__, "device": device, "steps": steps, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
