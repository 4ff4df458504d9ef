"""A policy compiled for torch on one device: the Plan, and what apply must add to torch.autocast.

``plan.details`` (:class:`TorchDetails`): ``autocast`` (torch.autocast's dtype, or None), ``op_moves`` (torch
function name -> category, the ops unimp runs differently from torch's lists) and ``eager_mechanism``
(``autocast_kernels``, ``function_mode`` or None). Under ``torch.compile`` moves are traced through ``PolicyMode``.

>>> import unimp
>>> from unimp.spi import Plan
>>> request = lambda name: Plan.request(unimp.load(name), "torch")
>>> compile_plan(request("torch_autocast_cpu"), device="cpu").details.op_moves
{}
>>> plan = compile_plan(request("mixed_bf16"), device="cpu")
>>> plan.details.op_moves["softmax"], plan.details.op_moves["exp"], plan.details.eager_mechanism
('float32', 'float32', 'autocast_kernels')
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from unimp.spi import Fp8Support, LayerInfo, Plan, PlanRequest, UnsupportedError, dtypes, hardware, ops

from .autocast import ALSO_MOVED, aten_names, function_names, is_torch_own, kernel_table, moves, native_category, same

BATCH_NORM_NOTE = ("batch_norm: torch's kernels take low-precision activations with float32 weights "
                   "and compute statistics and normalisation in float32; activations keep their dtype "
                   "(as Keras mixed precision does)")


def resolve_compute(dtype: str, device: str) -> tuple[str, str]:
    """The compute dtype on ``device`` (``auto`` resolved) and why; UnsupportedError when impossible."""
    import torch

    if device not in ("cpu", "cuda"):
        raise UnsupportedError(f"unimp-torch runs models on cpu or cuda; this model is on {device!r} "
                               f"(move it with model.to('cuda') or model.to('cpu'))")
    if dtype == "auto":
        if device == "cuda":
            if not torch.cuda.is_available():
                return "bfloat16", "auto: cuda (no GPU visible to check; bf16 GPUs are the common case)"
            # bf16 tensor cores from compute capability 8.0 (torch.cuda.is_bf16_supported() counts emulation)
            cc, name = torch.cuda.get_device_capability(), torch.cuda.get_device_name()
            return hardware.resolve_auto(fast_bf16=cc >= (8, 0), fast_fp16=True,
                                where=f"this GPU ({name}, compute capability {cc[0]}.{cc[1]})")
        return hardware.resolve_cpu_auto("torch")  # CPU autocast float16 would need loss scaling: never auto on CPU
    check_dtype(dtype, device, "compute_dtype")
    if device == "cpu" and dtypes.is_low(dtype) and hardware.cpu().emulated(dtype):
        return dtype, f"as the policy says (emulated on this CPU, slower than float32: {hardware.cpu().describe()})"
    return dtype, "as the policy says"


def check_dtype(dtype: str, device: str, key: str) -> None:
    import torch

    if not dtypes.is_low(dtype):
        return
    if (device == "cuda" and dtype == "bfloat16" and torch.cuda.is_available()
            and not torch.cuda.is_bf16_supported()):
        raise UnsupportedError(f"{key} = 'bfloat16' but this GPU has no bfloat16; use 'float16' "
                               f"(with loss_scale.mode = 'dynamic') or 'auto'")
    if device == "cpu":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = torch.autocast("cpu", dtype=getattr(torch, dtype)).fast_dtype == getattr(torch, dtype)
        if not ok or any("not supported" in str(w.message) for w in caught):
            raise UnsupportedError(f"{key} = {dtype!r}: torch {torch.__version__} CPU autocast does not "
                                   f"support it; use 'bfloat16' or 'float32', or run on cuda")
        hardware.warn_emulated(dtype, key, "torch's CPU autocast")


@dataclass(frozen=True)
class TorchDetails:
    """What the torch backend decided at compile time (``plan.details``)."""

    device: str  # cpu | cuda
    autocast: str | None  # the dtype torch.autocast runs, or None
    op_moves: Mapping[str, str]  # torch function name -> category unimp runs it in
    eager_mechanism: str | None  # autocast_kernels | function_mode | None


def compile_plan(request: PlanRequest, model: Any = None, device: str | None = None,
                 index: Iterable[LayerInfo] | None = None, fp8_missing: str | None = None) -> Plan:
    """The torch Plan of ``request`` (:meth:`Plan.request`, what ``TorchBackend.plan`` receives) on ``device`` (``cpu``
    | ``cuda``; default: ``model``'s); ``index``: the model's modules (default: ``model``'s); ``fp8_missing``: why FP8
    cannot run (a backend built on this one without torchao's FP8, e.g. ipex), else torchao's support is checked."""
    from .validate import device_of

    device = device or device_of(model)
    if index is None and model is not None:
        from .index import model_index

        index = model_index(model)
    compute, reason = resolve_compute(request.compute_dtype, device)
    request = request.at(compute)
    for setting, dtype in request.compute_requests()[1:]:  # the overrides' (the compute dtype is checked)
        check_dtype(dtype, device, setting)
    # the low dtypes the forward meets: the compute dtype and the overrides'; a float32 compute dtype with lowered
    # layers runs autocast to float32
    lows = set(request.low_dtypes)
    autocast = compute if dtypes.is_low(compute) else "float32" if lows else None
    mixing = request.mixes_compute
    control, native, op_moves, notes = {}, {}, {}, []
    own = autocast is not None and is_torch_own(request, device)
    for op in ops.CANONICAL_OPS:
        wanted = request.op(op).requested
        names = function_names(op, device)
        native[op] = aten_names(op, device)
        control[op] = "op"
        if autocast is None:
            continue  # no autocast: nothing is lowered, float32 ops run in float32, the rest follow inputs
        if op == "batch_norm" and wanted == "float32":
            notes.append(BATCH_NORM_NOTE)
            continue
        moved = moves(op, wanted, device, own, other_low=bool(lows - {autocast}))
        op_moves.update(dict.fromkeys(moved, wanted))
        kept = [n for n in names if n not in moved and not same(native_category(n, device), wanted, n)]
        # an override's outputs may reach them next to another dtype: mixed inputs promote (torch refuses them)
        promoted = [n for n in kept if mixing and native_category(n, device) == "inputs"]
        op_moves.update(dict.fromkeys(promoted, "promote"))
        if kept:
            also = [n for n in kept if n in ALSO_MOVED.get(op, ())]
            why = (f": this policy's op lists are torch's own on {device}, so it runs as plain torch.autocast "
                   f"(other policies run {', '.join(also)} as {op} says)") if also else ""
            notes.append(f"{op}: torch keeps its own choice for {', '.join(kept)} "
                         f"({native_category(kept[0], device)} on {device}){why}"
                         + (f"; mixed input dtypes promote to the widest ({', '.join(promoted)})" if promoted else ""))
    mechanism = None if not op_moves else "autocast_kernels" if kernel_table(op_moves, device) is not None \
        else "function_mode"
    details = TorchDetails(device, autocast, op_moves, mechanism)
    fp8 = None
    if fp8_missing is not None:
        fp8 = Fp8Support(missing=fp8_missing)
    elif request.fp8_requested:  # torchao is imported only for a policy that asks FP8
        from .fp8 import support

        fp8 = support(device)
    return request.compile(control=control, native=native, compute_reason=reason,
                           notes=tuple(notes), details=details, fp8=fp8, index=index)
