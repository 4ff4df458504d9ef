"""Distributed training under one policy: DDP and FSDP2 (``torch.distributed.fsdp.fully_shard``).

**DDP.** ``amp.ddp(...)`` works for any policy; ``unimp.apply(policy, DDP(model), opt)`` only when the policy
keeps every parameter in its dtype (DDP captures the parameters it reduces). Gradients are all-reduced in
``[distributed] reduce_dtype``: DDP's own all-reduce when they already have it, else a comm hook with the
semantics of torch's ``bf16_compress_hook``/``fp16_compress_hook``.

**FSDP2.** :func:`fully_shard` shards with a ``MixedPrecisionPolicy`` compiled from the policy
(:func:`mixed_precision_policy`); ``unimp.apply(policy, sharded, opt)`` checks every unit's dtypes against the
policy and binds the forward and the loss scaler. FSDP's sharded parameters *are* the master weights.

**Agreement.** With scaling or ``skip_nonfinite``, ``amp.optimizer.step()`` all-reduces found-inf with MAX on the
device, so every rank skips the same steps and holds the same scale.

>>> import unimp
>>> mp = mixed_precision_policy(unimp.load("pure_bf16"), root=True)
>>> mp.param_dtype, mp.reduce_dtype, mp.output_dtype, mp.cast_forward_inputs
(torch.bfloat16, torch.float32, None, False)
>>> mixed_precision_policy(unimp.load("fp32"), root=True).output_dtype
torch.float32
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from unimp.spi import Plan, PlanRequest, UnimpWarning, UnsupportedError, load

from .casts import DTYPES, NAMES, output_cast
from .kinds import kind, type_names

ORDER_FIX = ("amp = unimp.apply(policy, model, optimizer); model = amp.ddp(**ddp_kwargs) "
             "(unimp first, then DDP, so DDP reduces the parameters the policy gives the model)")


def is_ddp(model: Any) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


@dataclass
class ReduceState:
    """State of :func:`reduce_hook`: the process group (None = WORLD) and the reduction dtype."""

    process_group: Any
    dtype: torch.dtype


def reduce_hook(state, bucket):  # no annotations: DDP checks them against the real (non-string) types
    """DDP comm hook ``(ReduceState, dist.GradBucket) -> Future[Tensor]``: the bucket's mean, reduced
    in ``state.dtype``, back in the bucket's dtype (torch's ``_compress_hook``; in place when already in it)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    buffer = bucket.buffer()
    if buffer.dtype == state.dtype:
        fut = dist.all_reduce(buffer.div_(world), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    reduced = buffer.to(state.dtype).div_(world)

    def back(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return dist.all_reduce(reduced, group=group, async_op=True).get_future().then(back)


def check_ddp_order(plan: Plan, ddp: nn.Module) -> None:
    """Refuse ``unimp.apply(policy, DDP(model))`` when apply would replace parameters DDP holds."""
    moved = []
    for path, m in ddp.module.named_modules():
        want = DTYPES[plan.decide(path, kind(m), type_names(m)).param_dtype]
        moved += [f"{path}.{n}" if path else n for n, p in m.named_parameters(recurse=False)
                  if p.is_floating_point() and p.dtype not in (want, torch.float64)]
    if moved:
        raise UnsupportedError(
            f"unimp.apply(policy, DistributedDataParallel(model)): policy {plan.name!r} gives "
            f"{len(moved)} parameters another dtype ({', '.join(moved[:4])}{', ...' if len(moved) > 4 else ''}), "
            f"but DDP already holds the float32 ones and would never reduce the new ones; "
            f"fix: {ORDER_FIX}")


def attach_ddp(amp: Any, ddp: nn.Module, owned: bool) -> None:
    """Register the reduce hook on ``ddp`` (when needed) and agree found-inf over its group."""
    want = DTYPES[amp.plan.reduce_dtype]
    grads = {p.dtype for p in ddp.module.parameters() if p.requires_grad}
    hooked = bool(grads) and grads != {want}
    if hooked:
        try:
            ddp.register_comm_hook(ReduceState(ddp.process_group, want), reduce_hook)
        except RuntimeError as e:
            raise UnsupportedError(
                f"DistributedDataParallel: cannot register unimp's reduce_dtype={NAMES[want]} comm hook "
                f"({e}); do not register another comm hook, or set distributed.reduce_dtype to the "
                f"gradients' dtype ({', '.join(sorted(NAMES.get(d, str(d)) for d in grads))})") from None
    group = ddp.process_group
    amp.distributed = {
        "engine": "ddp", "world_size": group.size(), "reduce_dtype": NAMES[want],
        "all_reduce": ("unimp comm hook (cast to reduce_dtype, /world, all-reduce, cast back)" if hooked
                       else "DDP default all-reduce (gradients already in reduce_dtype)"),
        "found_inf": "all_reduce MAX over the process group", "order": "amp.ddp()" if owned else "DDP first"}
    _agree_over(amp, [group])


def make_ddp(amp: Any, **kwargs: Any) -> nn.Module:
    """``DistributedDataParallel(amp.model, **kwargs)`` under the policy; sets and returns ``amp.model``."""
    if getattr(amp, "distributed", None):
        raise RuntimeError(f"amp.ddp(): this Amp is already distributed ({amp.distributed['engine']}); "
                           f"use amp.model")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("amp.ddp(): torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first (torchrun sets the env)")
    inner = amp.model
    ddp = nn.parallel.DistributedDataParallel(inner, **kwargs)
    if amp.params.masters:  # DDP broadcast the model's low params from rank 0; the masters must follow
        group = ddp.process_group
        src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        with torch.no_grad():
            for _, _, master in amp.params.masters:
                dist.broadcast(master.data, src=src, group=group)
        amp.params.sync_low()
    attach_ddp(amp, ddp, owned=True)
    amp.model = ddp
    amp._undo.append(lambda: setattr(amp, "model", inner))
    amp.bind_also(ddp)
    return ddp


def is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def mixed_precision_policy(policy: Any, param_dtype: str | None = None, *, root: bool = False) -> Any:
    """The ``MixedPrecisionPolicy`` of one FSDP unit under ``policy``.

    ``param_dtype`` defaults to the policy's; ``reduce_dtype`` = ``[distributed] reduce_dtype``; the root casts
    outputs to ``output_dtype`` (None for ``"unchanged"``); ``cast_forward_inputs=False``: a policy decides per op.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    request = _request(policy)
    return MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype or request.param_dtype],
                                reduce_dtype=DTYPES[request.reduce_dtype],
                                output_dtype=output_cast(request) if root else None,
                                cast_forward_inputs=False)


def _request(policy: Any) -> PlanRequest:
    """What the user's ``policy`` (a Plan's request, or anything :func:`unimp.load` takes) asks of torch."""
    return policy if isinstance(policy, PlanRequest) else Plan.request(load(policy), "torch")


Units = type | tuple[type, ...] | str | Iterable[str] | Callable[[str, nn.Module], bool] | None


def _matcher(units: Units) -> Callable[[str, nn.Module], bool]:
    if units is None:
        return lambda path, m: False
    if isinstance(units, type) or (isinstance(units, tuple) and units and all(isinstance(u, type) for u in units)):
        classes = cast("type | tuple[type, ...]", units)
        return lambda path, m: isinstance(m, classes)
    if isinstance(units, str):
        units = [units]
    if callable(units):
        return units
    items = list(units)
    globs = [g for g in items if isinstance(g, str)]
    if len(globs) != len(items):
        raise TypeError("units: expected module classes, path globs (e.g. 'layers.*'), or a callable "
                        f"(path, module) -> bool; got {units!r}")
    return lambda path, m: any(fnmatch.fnmatchcase(path, g) for g in globs)


def _direct_params(m: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in m.named_parameters(recurse=False) if p.is_floating_point()]


def fully_shard(model: nn.Module, policy: Any, *, units: Units = None, **kwargs: Any) -> nn.Module:
    """Shard ``model`` with FSDP2 under ``policy``; returns ``model`` (an ``FSDPModule``).

    Every module matched by ``units`` (classes, path globs or ``callable(path, module)``) becomes an FSDP unit, then
    the root, each with :func:`mixed_precision_policy`; modules whose param dtype differs from their unit's get a
    unit of their own. ``kwargs`` go to ``torch.distributed.fsdp.fully_shard``. Then build the optimizer and call
    ``unimp.apply(policy, model, optimizer)``. FP8 layers are converted before sharding (tensorwise: all-gathered
    in FP8) and stay FP8 after ``amp.remove()``.
    """
    from torch.distributed.fsdp import fully_shard as shard

    request = _request(policy)
    if is_fsdp(model):
        raise RuntimeError("unimp_torch.fully_shard: the model is already sharded; call it on the plain "
                           "model (it shards the units and the root itself)")
    if request.fp8_requested:
        from .fp8 import convert
        from .plan import compile_plan
        from .validate import device_of

        plan = compile_plan(request, device=device_of(model))
        if plan.fp8 is not None and plan.fp8.active:
            convert(plan, model, plan.details.device, fsdp=True)
    match = _matcher(units)
    modules = dict(model.named_modules())
    roots = [p for p, m in modules.items() if p and match(p, m)] + [""]

    def unit_of(path: str, among: list[str]) -> str:
        return max((u for u in among if not u or path == u or path.startswith(u + ".")), key=len)

    want = {p: request.param_dtype_of(p, kind(m), type_names(m))
            for p, m in modules.items() if _direct_params(m)}
    dtypes: dict[str, str] = {}
    extra: list[str] = []
    for u in roots:  # each unit's dtype: the one most of its own parameters want
        own = [p for p in want if unit_of(p, roots) == u]
        count: dict[str, int] = {}
        for p in own:
            count[want[p]] = count.get(want[p], 0) + sum(t.numel() for _, t in _direct_params(modules[p]))
        dtypes[u] = want[u] if u in want else max(count, key=lambda d: count[d]) if count else request.param_dtype
        for p in own:
            if want[p] != dtypes[u] and p != u:
                extra.append(p)
                dtypes[p] = want[p]
    if not request.master_weights.enabled:  # no masters: the sharded params themselves hold the dtype
        with torch.no_grad():
            for p, d in want.items():
                for _, t in _direct_params(modules[p]):
                    t.data = t.data.to(DTYPES[d])
    for u in sorted(roots + extra, key=lambda p: -1 if not p else p.count("."), reverse=True):
        shard(modules[u], mp_policy=mixed_precision_policy(request, dtypes[u], root=not u), **kwargs)
    return model


def check_fsdp(model: nn.Module, plan: Plan) -> None:
    """Every FSDP unit's dtypes must be what the Plan asks; else a clear error with the fix."""
    from torch.distributed.fsdp import FSDPModule

    path_of = {id(m): p for p, m in model.named_modules()}
    seen: set[int] = set()
    wrong = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None:
            continue
        mp = group.mp_policy
        for fp in group.fsdp_params:
            info = fp._module_info
            path = path_of.get(id(info.module), "?")
            name = f"{path}.{info.param_name}" if path else info.param_name
            seen.add(id(fp.sharded_param))
            orig = fp.sharded_param.dtype
            fwd = mp.param_dtype or orig
            red = mp.reduce_dtype or fwd
            d = plan.decide(path, kind(info.module), type_names(info.module))
            want_fwd = DTYPES[d.param_dtype]
            want_orig = DTYPES[plan.master_weights.dtype] if (
                plan.master_weights.enabled and want_fwd != torch.float32) else want_fwd
            if orig == torch.float64:
                continue
            if fwd != want_fwd:
                wrong.append(f"{name}: param_dtype {NAMES.get(fwd)} (policy: {d.param_dtype})")
            elif orig != want_orig:
                wrong.append(f"{name}: sharded (master) dtype {NAMES.get(orig)} (policy: {NAMES[want_orig]})")
            elif red != DTYPES[plan.reduce_dtype]:
                wrong.append(f"{name}: reduce_dtype {NAMES.get(red)} (policy: {plan.reduce_dtype})")
    loose = [n for n, p in model.named_parameters() if id(p) not in seen and p.requires_grad]
    if wrong or loose:
        lines = wrong[:6] + [f"{n}: not managed by FSDP (fully_shard the root module too)" for n in loose[:3]]
        more = len(wrong) + len(loose) - len(lines)
        raise UnsupportedError(
            f"unimp.apply: this FSDP2 model's mixed precision differs from policy {plan.name!r}:\n  "
            + "\n  ".join(lines) + (f"\n  ... and {more} more" if more > 0 else "")
            + "\nfix: shard with unimp_torch.fully_shard(model, policy, units=...), or pass "
              "mp_policy=unimp_torch.mixed_precision_policy(policy[, param_dtype], root=...) to fully_shard")


def attach_fsdp(amp: Any, model: nn.Module) -> None:
    """The found-inf flag agreed over every process group of the sharded parameters' meshes (each once)."""
    meshes = {id(m): m for p in model.parameters() if (m := getattr(p, "device_mesh", None)) is not None}
    groups = list({id(g): g for mesh in meshes.values() for g in map(mesh.get_group, range(mesh.ndim))}.values())
    amp.distributed = {
        "engine": "fsdp2", "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "reduce_dtype": amp.plan.reduce_dtype,
        "all_reduce": "FSDP2 reduce-scatter in MixedPrecisionPolicy.reduce_dtype",
        "masters": f"FSDP's sharded parameters ({amp.plan.master_weights.dtype}, 1/world per rank)",
        "found_inf": "all_reduce MAX over the mesh"}
    _agree_over(amp, groups)


def _agree_over(amp: Any, groups: list[Any]) -> None:
    def agree(found: torch.Tensor) -> None:
        for g in groups:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=g)

    amp.agree = agree
    for opt in amp.optimizers:
        opt.agree = agree


def warn_undistributed() -> None:
    """Once per optimizer: a multi-rank job whose Amp does not know it is data-parallel."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warnings.warn(
            f"unimp: torch.distributed runs {dist.get_world_size()} ranks but this Amp is not "
            f"distributed, so ranks may skip different steps and gradients reduce in DDP's dtype; "
            f"use {ORDER_FIX}, or unimp_torch.fully_shard(model, policy) + unimp.apply for FSDP2",
            UnimpWarning, stacklevel=3)
