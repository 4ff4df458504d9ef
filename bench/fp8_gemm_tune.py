"""The FP8 GEMM microbenchmark ``unimp tune`` decides with (``unimp_torch.tuning``), checked and timed on a GPU.

    python bench/fp8_gemm_tune.py --out gemm.json     # H200: correctness, then Llama-8B's linear shapes per recipe
    python bench/fp8_gemm_tune.py --smoke             # CPU: the correctness check; no timing there

1. Correctness: one training step's three GEMMs (forward, grad-input, grad-weight) through the
   microbenchmark's FP8 path (``torch._scaled_mm`` with the recipe's scaling and the transposed copies)
   against float32, per recipe: the relative error must be what rounding the operands to e4m3/e5m2
   explains (``u * sqrt(3)``: two operands and the output), or the layouts/scales are wrong.
2. ``TorchTuning().fp8_gemm_times`` for the linear shapes of a Llama-3-8B layer at 8192 tokens (and a
   small layer where FP8 should lose): bf16 ms, FP8 ms and the speed-up per recipe, as ``unimp tune``
   puts them in a tuned policy's comments.
3. With torchao installed: the same shapes through torchao's ``Float8Linear`` (forward + backward,
   compiled) against ``nn.Linear`` in bf16, the real layer the microbenchmark stands in for.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from unimp.dtypes import UNIT_ROUNDOFF
from unimp_torch import tuning

RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp")
SHAPES = [(8192, 4096, 4096), (8192, 4096, 1024), (8192, 4096, 14336), (8192, 14336, 4096), (256, 64, 64)]


def grad_format(recipe: str) -> str:
    return "e5m2" if recipe == "tensorwise" else "e4m3"  # torchao's: rowwise recipes take e4m3 gradients


def correctness(device: torch.device) -> dict[str, list[float]]:
    out = {}
    for recipe in RECIPES:
        fmt = grad_format(recipe)
        x, w, g = (torch.randn(*s, device=device, dtype=torch.bfloat16) for s in ((256, 512), (1024, 512), (256, 1024)))
        fp8 = tuning._fp8_step(recipe, torch.bfloat16, getattr(torch, {"e5m2": "float8_e5m2",
                                                                        "e4m3": "float8_e4m3fn"}[fmt]))(x, w, g)
        exact = tuning._high_step(x.float(), w.float(), g.float())
        errors = [float((a.float() - b).norm() / b.norm()) for a, b in zip(fp8, exact, strict=True)]
        bounds = [UNIT_ROUNDOFF["e4m3"] * math.sqrt(3), *[UNIT_ROUNDOFF[fmt] * math.sqrt(3)] * 2]
        print(f"{recipe:14} relative error y/gx/gw {[round(e, 4) for e in errors]} "
              f"(bounds {[round(b, 4) for b in bounds]})")
        assert all(e <= b for e, b in zip(errors, bounds, strict=True)), (recipe, errors, bounds)
        out[recipe] = errors
    return out


def microbenchmark(device: torch.device) -> dict[str, dict[str, list[float]]]:
    model = torch.nn.Linear(16, 16, device=device)  # only its device is read
    out: dict[str, dict[str, list[float]]] = {}
    for recipe in RECIPES:
        start = time.perf_counter()
        times = tuning.TorchTuning().fp8_gemm_times(model, SHAPES, recipe, "bfloat16", grad_format(recipe))
        if isinstance(times, str):
            print(f"{recipe}: {times}")
            return {}
        for shape, (high, fp8) in times.items():
            print(f"{recipe:14} M x K x N = {'x'.join(map(str, shape)):18} bf16 {high * 1e3:7.3f} ms  fp8 "
                  f"{fp8 * 1e3:7.3f} ms  speed-up {high / fp8:.2f}x")
            out.setdefault(recipe, {})["x".join(map(str, shape))] = [high, fp8, high / fp8]
        print(f"  ({time.perf_counter() - start:.0f} s with compilation)")
    return out


def torchao_layers(device: torch.device) -> dict[str, dict[str, float]]:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        print("torchao not installed: the real Float8Linear comparison is skipped")
        return {}
    out: dict[str, dict[str, float]] = {}
    names = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
    for recipe in RECIPES:
        for m, k, n in SHAPES:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
            times = []
            for fp8 in (False, True):
                layer = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
                if fp8:
                    convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(names[recipe]))
                step = torch.compile(lambda layer=layer, x=x: layer(x).sum().backward())
                times.append(tuning._seconds(lambda *_, step=step: step(), (m, k, n), torch.bfloat16, device))
            print(f"{recipe:14} torchao Float8Linear {m}x{k}x{n}: bf16 {times[0] * 1e3:.3f} ms, fp8 "
                  f"{times[1] * 1e3:.3f} ms, speed-up {times[0] / times[1]:.2f}x")
            out.setdefault(recipe, {})[f"{m}x{k}x{n}"] = times[0] / times[1]
    return out


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON")
    ap.add_argument("--smoke", action="store_true", help="CPU: check that nothing is measured there")
    args = ap.parse_args(argv)
    if args.smoke or not torch.cuda.is_available():  # torch._scaled_mm runs on CPU too (torch >= 2.13): not timed
        note = tuning.TorchTuning().fp8_gemm_times(torch.nn.Linear(16, 16), SHAPES, "tensorwise", "bfloat16", "e5m2")
        print(note)
        return {"correctness": correctness(torch.device("cpu")), "cpu": note}
    device = torch.device("cuda")
    print(torch.__version__, torch.cuda.get_device_name(device))
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "correctness": correctness(device), "microbenchmark": microbenchmark(device),
               "torchao": torchao_layers(device)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
