"""What ``unimp.tune`` measures through torch (``TorchBackend.tuning()``): no-grad evaluation, ``nn.Linear`` GEMM
shapes, the FP8 GEMM microbenchmark and Hutchinson Hessian traces.

The microbenchmark times a linear layer's three training GEMMs (``x @ w.T``, ``g @ w``, ``g.T @ x``) in the
compute dtype and in FP8 with the policy's recipe, including the recipe's amax, scales, casts and transposed
copies, both under ``torch.compile``; only on CUDA with compute capability 8.9+, elsewhere it says why not.

>>> import torch
>>> t = TorchTuning()
>>> model = torch.nn.Sequential(torch.nn.Linear(32, 16))
>>> t.gemm_shapes(model, ["0"], lambda: model(torch.zeros(4, 8, 32)))
{'0': (32, 32, 16)}
>>> t.fp8_gemm_times(model, [(32, 32, 16)], "tensorwise", "bfloat16", "e5m2")
'not measured (no FP8 GEMMs on this device: cpu)'
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves  # tuples/lists, dicts, HF ModelOutputs (registered by transformers)

from unimp.spi import dtypes

from .fp8 import FP8_CUDA
from .validate import first_device

Shape = tuple[int, int, int]
WARMUP, REPEATS = 3, 20
STEP_REPEATS, STEP_BLOCKS = 15, 2  # timed training steps per candidate set; blocks of a cut stack
MAX_KEPT = 1 << 22  # elements kept per recorded output (16 MiB in float32)


class TorchTuning:
    """The torch backend's tuning measurements (:mod:`unimp.tuning.measurements`)."""

    def evaluating(self) -> Any:
        return torch.no_grad()

    def record_outputs(self, model: nn.Module) -> Any:
        """A context whose list gets, per forward of ``model``, its floating outputs (float32 copies, flattened; past
        ``MAX_KEPT`` elements a fixed stride of them)."""
        return _Recorder(model)

    def output_divergence(self, reference: list[list[torch.Tensor]], other: list[list[torch.Tensor]]) -> float:
        """``||other - reference|| / ||reference||`` over every recorded output (inf when they do not pair up or
        ``other`` is not finite)."""
        pairs = [(a, b) for ra, rb in zip(reference, other, strict=False) for a, b in zip(ra, rb, strict=False)]
        if len(reference) != len(other) or any(len(ra) != len(rb) for ra, rb in zip(reference, other, strict=False)) \
                or any(a.shape != b.shape for a, b in pairs) or not all(bool(b.isfinite().all()) for _, b in pairs):
            return math.inf
        num = math.fsum(float((b.double() - a.double()).square().sum()) for a, b in pairs)
        den = math.fsum(float(a.double().square().sum()) for a, _ in pairs)
        return math.sqrt(num / den) if den else (0.0 if num == 0 else math.inf)

    def gemm_shapes(self, model: nn.Module, paths: Sequence[str], run: Callable[[], Any]) -> dict[str, Shape]:
        """``(M, K, N)`` of each ``nn.Linear`` at ``paths`` in one ``run()``: M the rows of its input (the largest
        call's, for a layer called more than once)."""
        shapes: dict[str, Shape] = {}
        handles = []
        for path in paths:
            module = model.get_submodule(path)
            if not isinstance(module, nn.Linear):
                continue

            def seen(mod: nn.Linear, args: tuple[Any, ...], kwargs: dict[str, Any], path: str = path) -> None:
                x = args[0] if args else next(iter(kwargs.values()))
                m = x.numel() // max(x.shape[-1], 1)
                if m > shapes.get(path, (0,))[0]:
                    shapes[path] = (m, mod.in_features, mod.out_features)

            handles.append(module.register_forward_pre_hook(seen, with_kwargs=True))
        try:
            run()
        finally:
            for h in handles:
                h.remove()
        return shapes

    def fp8_gemm_times(self, model: nn.Module, shapes: Iterable[Shape], recipe: str, compute_dtype: str,
                       gradient_format: str) -> dict[Shape, tuple[float, float]] | str:
        """Per shape: seconds of one step's GEMMs in ``compute_dtype`` and in FP8 (median of ``REPEATS``)."""
        why = self.no_fp8_speed(model)
        if why:
            return why
        device = first_device(model)
        high = getattr(torch, compute_dtype)
        grad = getattr(torch, dtypes.FP8_FORMATS[gradient_format])
        out: dict[Shape, tuple[float, float]] = {}
        try:
            for shape in shapes:
                high_s, fp8_s = (_seconds(step, shape, high, device) for step in
                                 (torch.compile(_high_step), torch.compile(_fp8_step(recipe, high, grad))))
                out[shape] = (high_s, fp8_s)
        except Exception as e:  # torch refuses this recipe/format/shape on this GPU: say so, decide nothing on it
            return f"not measured (torch._scaled_mm: {type(e).__name__}: {str(e).splitlines()[0][:200]})"
        return out

    def no_fp8_speed(self, model: nn.Module) -> str | None:
        """Why FP8 speed cannot be measured where ``model`` is (no FP8 GEMMs there: FP8 is emulated), or None."""
        device = first_device(model)
        if device.type != "cuda":
            return f"not measured (no FP8 GEMMs on this device: {device.type})"
        cc = torch.cuda.get_device_capability(device)
        if cc < FP8_CUDA:
            return (f"not measured (this GPU, {torch.cuda.get_device_name(device)}, compute capability "
                    f"{cc[0]}.{cc[1]}, has no FP8 GEMMs: torch._scaled_mm needs {FP8_CUDA[0]}.{FP8_CUDA[1]}+)")
        return None

    def device_kind(self, model: nn.Module) -> str:
        """The kind of device ``model`` is on, as speed decisions are tied to it: the GPU's name, or ``cpu``."""
        device = first_device(model)
        return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type

    def fp8_candidate_sets(self, model: nn.Module, paths: Sequence[str], recipe: str) -> dict[str, list[str]]:
        """torchao's own layer filters as candidate FP8 sets (where torchao imports): its default and
        ``_auto_filter_for_recipe`` (as torchtitan's ``filter_fqns``, ``auto_filter_small_kn``), within ``paths``."""
        linears = {p: m for p, m in model.named_modules() if p in set(paths) and isinstance(m, nn.Linear)}
        keep_out = ("lm_head", "output")
        sets = {"torchao default filter": [p for p, m in linears.items() if not any(k in p for k in keep_out)
                                           and m.in_features % 16 == 0 and m.out_features % 16 == 0]}
        try:
            from torchao.float8 import _auto_filter_for_recipe

            auto = _auto_filter_for_recipe(recipe, filter_fqns=list(keep_out))
            sets["torchao auto filter"] = [p for p, m in linears.items() if auto(m, p)]
        except Exception:  # torchao absent or without this recipe: its default's rule above still stands
            pass
        return sets

    def step_seconds(self, model: nn.Module, policy: Any, loss_fn: Callable[[Any, Any], Any], batch: Any,
                     compiled: bool) -> float:
        """Median seconds of one training step (``amp.backward(loss_fn(model, batch))``) of a copy of ``model``
        under ``policy``, compiled when ``compiled``. A stack of three or more identical blocks is cut to its first
        ``STEP_BLOCKS`` in the copy (the sets rank alike, at a fraction of the compile time)."""
        import copy

        from unimp.spi import apply

        torch._dynamo.reset()  # one compile per set: dynamo's per-code cache would fill up and fall back to eager
        m = copy.deepcopy(model)
        _cut_stack(m, STEP_BLOCKS)
        amp: Any = apply(policy, m)  # a torch model's Amp (unimp-torch's or unimp-ipex's): its backward()
        run = torch.compile(amp.model) if compiled else amp.model
        params = [p for p in m.parameters() if p.requires_grad]
        device = first_device(m)

        def step() -> None:
            amp.backward(loss_fn(run, batch))
            for p in params:
                p.grad = None

        try:
            for _ in range(WARMUP):
                step()
            return statistics.median(_step_time(step, device) for _ in range(STEP_REPEATS))
        finally:
            amp.remove()
            torch._dynamo.reset()

    def hessian_traces(self, model: nn.Module, loss_fn: Callable[[Any, Any], Any], batches: Sequence[Any],
                       paths: Sequence[str], samples: int, seed: int) -> dict[str, tuple[float, int]]:
        """Hutchinson: ``tr(H_l) ~ mean over v of v_l . (H v)_l`` with one Rademacher ``v`` over the parameters of
        every layer at ``paths`` (cross terms vanish in expectation), per batch; ``(trace, parameter count)``."""
        own = {p: [t for t in model.get_submodule(p).parameters() if t.requires_grad] for p in paths}
        params = list({id(t): t for ts in own.values() for t in ts}.values())
        index = {id(t): i for i, t in enumerate(params)}
        gen = torch.Generator().manual_seed(seed)
        sums = dict.fromkeys(own, 0.0)
        for batch in batches:
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
                raise TypeError("hessian_samples > 0 needs loss_fn to return the loss tensor with its graph (not "
                                "loss.item() or a float, and not under torch.no_grad()): the Hutchinson estimate "
                                "differentiates it twice")
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for _ in range(samples):
                vs = [(torch.randint(0, 2, t.shape, generator=gen) * 2 - 1).to(t) for t in params]
                hvs = torch.autograd.grad(grads, params, grad_outputs=vs, retain_graph=True)
                dots = [float((v * hv).sum()) for v, hv in zip(vs, hvs, strict=True)]
                for p, ts in own.items():
                    sums[p] += sum(dots[index[id(t)]] for t in ts)
        n = len(batches) * samples
        return {p: (sums[p] / n, sum(t.numel() for t in ts)) for p, ts in own.items() if ts}


class _Recorder:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.outputs: list[list[torch.Tensor]] = []
        self.handle: Any = None

    def __enter__(self) -> list[list[torch.Tensor]]:
        def seen(module: nn.Module, args: Any, output: Any) -> None:
            self.outputs.append([_kept(t) for t in tree_leaves(output)
                                 if isinstance(t, torch.Tensor) and t.is_floating_point()])

        self.handle = self.model.register_forward_hook(seen)
        return self.outputs

    def __exit__(self, *exc: Any) -> None:
        self.handle.remove()


def _kept(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    step = -(-flat.numel() // MAX_KEPT)
    return flat[::step].float().clone()


def _high_step(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x @ w.t(), g @ w, g.t() @ x


def _fp8(t: torch.Tensor, fmt: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` scaled into ``fmt``'s range (one scale, or one per slice along ``dim``) and cast; and the inverse scale."""
    top = torch.finfo(fmt).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = top / amax.float().clamp(min=1e-12)
    return (t.float() * scale).clamp(-top, top).to(fmt), scale.reciprocal()


def _mm(a: torch.Tensor, b: torch.Tensor, fa: torch.dtype, fb: torch.dtype, rowwise: bool,
        out: torch.dtype) -> torch.Tensor:
    """``a @ b`` through ``torch._scaled_mm``: ``a`` row-major and ``b`` column-major, as it needs (copies made)."""
    qa, sa = _fp8(a, fa, -1 if rowwise else None)
    qb, sb = _fp8(b.t(), fb, -1 if rowwise else None)  # b's columns are the rows of b.T
    return torch._scaled_mm(qa.contiguous(), qb.contiguous().t(), scale_a=sa, scale_b=sb.t() if rowwise else sb,
                            out_dtype=out)


def _fp8_step(recipe: str, high: torch.dtype, grad: torch.dtype) -> Callable[..., tuple[torch.Tensor, ...]]:
    e4m3 = torch.float8_e4m3fn
    rowwise = recipe in ("rowwise", "rowwise_gw_hp")

    def step(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = _mm(x, w.t(), e4m3, e4m3, rowwise, high)
        gx = _mm(g, w, grad, e4m3, rowwise, high)
        gw = g.t() @ x if recipe == "rowwise_gw_hp" else _mm(g.t(), x, grad, e4m3, rowwise, high)
        return y, gx, gw

    return step


def _seconds(step: Callable[..., Any], shape: Shape, dtype: torch.dtype, device: torch.device) -> float:
    m, k, n = shape
    m = -(-m // 16) * 16  # torch._scaled_mm takes dims in multiples of 16 (torchao pads the same way)
    gen = torch.Generator(device).manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen, device=device, dtype=dtype) for s in ((m, k), (n, k), (m, n)))
    for _ in range(WARMUP):
        step(x, w, g)
    return statistics.median(_step_time(lambda: step(x, w, g), device) for _ in range(REPEATS))


def _cut_stack(model: nn.Module, keep: int) -> None:
    """Cut the longest ``nn.ModuleList`` of three or more same-class modules to its first ``keep``."""
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > max(keep, 2)
              and len({type(c) for c in m}) == 1]
    if stacks:
        del max(stacks, key=len)[keep:]


def _step_time(step: Callable[[], None], device: torch.device) -> float:
    """Seconds of one ``step()`` (CUDA events on a GPU, the wall clock elsewhere)."""
    if device.type != "cuda":
        t = time.perf_counter()
        step()
        return time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000
