"""FP8 training for torch through torchao's float8 training: the layers the Plan chooses, and undo.

``support(device)`` says what this torch + torchao can run; ``convert(plan, model)`` asks ``plan.decide_fp8`` per
``nn.Linear`` and hands those paths to ``torchao.float8.convert_to_float8_training`` with the recipe's
``Float8LinearConfig`` (on CPU in emulation mode: the FP8 numerics, not the speed).

>>> import torch, unimp
>>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
>>> amp = unimp.apply("fp8_tensorwise", model, torch.optim.AdamW(model.parameters()))
>>> [type(m).__name__ for m in model]
['Float8Linear', 'ReLU', 'Linear']
>>> amp.fp8_layers
{'0': 'tensorwise'}
>>> _ = amp.remove(); [type(m).__name__ for m in model]
['Linear', 'ReLU', 'Linear']
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch
from torch import nn

from unimp.spi import Fp8Decision, Fp8Support, Plan, UnsupportedError, dtypes

from .casts import DTYPES
from .kinds import type_names

RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}
TORCHAO = "torchao>=0.18,<0.19"  # what `pip install 'unimp-torch[fp8]'` installs
FP8_CUDA = (8, 9)  # torch._scaled_mm: FP8 tensor cores from compute capability 8.9 (Ada, Hopper)


def _torchao_version() -> str | None:
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return None


def _import_float8() -> Any:
    """``torchao.float8``, without the warnings torchao logs for its CUDA extensions on a CPU build."""
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        log.setLevel(level)
    return float8


def support(device: str) -> Fp8Support:
    """What torch + torchao run in FP8 on ``device``: linear layers, torchao's three dynamic recipes."""
    version = _torchao_version()
    if version is None:
        return Fp8Support(missing=f"FP8 training on torch runs through torchao, which is not installed "
                                  f"(pip install 'unimp-torch[fp8]', i.e. {TORCHAO!r})")
    try:
        float8 = _import_float8()
    except Exception as e:  # a torchao built for another torch fails here, not in the user's step
        return Fp8Support(missing=f"torchao {version} does not import with torch {torch.__version__} "
                                  f"({type(e).__name__}: {str(e)[:200]}); install {TORCHAO!r}")
    if device == "cuda" and torch.cuda.is_available():
        cc = torch.cuda.get_device_capability()
        if cc < FP8_CUDA:
            return Fp8Support(missing=f"this GPU ({torch.cuda.get_device_name()}, compute capability "
                                      f"{cc[0]}.{cc[1]}) has no FP8 tensor cores (torch._scaled_mm needs "
                                      f"{FP8_CUDA[0]}.{FP8_CUDA[1]}+: Ada, Hopper, Blackwell)")
    names = set(float8.Float8LinearRecipeName._value2member_map_)
    how = "torchao {v} convert_to_float8_training, Float8LinearConfig.from_recipe_name({r!r}){e}"
    emulated = ", emulate=True (CPU: the FP8 numerics, emulated matmuls)" if device == "cpu" else ""
    recipes = {ours: how.format(v=version, r=theirs, e=emulated) for ours, theirs in RECIPES.items()
               if theirs in names}
    why_not = {"delayed": f"torchao {version} has only dynamic scaling (delayed scaling was removed from "
                          f"torchao.float8 in 0.10); use recipe 'tensorwise', or Transformer Engine"}
    notes = ("FSDP2: a sharded tensorwise model all-gathers its weights in FP8 "
             "(Float8LinearConfig.enable_fsdp_float8_all_gather)",) if "tensorwise" in recipes else ()
    return Fp8Support(ops=("linear",), recipes=recipes, why_not=why_not, notes=notes)


def config(plan: Plan, device: str, fsdp: bool = False) -> Any:
    """The ``Float8LinearConfig`` of the Plan's recipe and gradient format on ``device``."""
    float8 = _import_float8()
    fp8 = plan.fp8
    assert fp8 is not None and fp8.active
    cfg = float8.Float8LinearConfig.from_recipe_name(RECIPES[fp8.recipe])
    grad = getattr(torch, dtypes.FP8_FORMATS[fp8.gradient_format])
    cfg = dataclasses.replace(
        cfg, emulate=device == "cpu",
        cast_config_grad_output=dataclasses.replace(cfg.cast_config_grad_output, target_dtype=grad),
        cast_config_grad_output_for_grad_weight=dataclasses.replace(
            cfg.cast_config_grad_output_for_grad_weight, target_dtype=grad),
        enable_fsdp_float8_all_gather=fsdp and fp8.recipe == "tensorwise")
    return cfg


def _own_class(module: nn.Module) -> type:
    """The module's class, seen through FSDP2's per-module subclass (``FSDPLinear`` -> ``Linear``)."""
    cls = type(module)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return cls
    return cls.__bases__[1] if cls.__bases__[:1] == (FSDPModule,) and len(cls.__bases__) == 2 else cls


def decisions(plan: Plan, model: nn.Module) -> list[Fp8Decision]:
    """The core's decision for every ``nn.Linear`` of ``model`` (the candidates for FP8)."""
    out = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if _own_class(module) is not nn.Linear and _own_class(module).__name__ != "Float8Linear":
            out.append(Fp8Decision(path, False, None, f"{type(module).__name__} is a subclass of nn.Linear (its "
                                                      f"forward may not be Linear's); torchao swaps plain "
                                                      f"nn.Linear only"))
            continue
        if not path:
            out.append(Fp8Decision(path, False, None, "the model itself is the Linear; FP8 swaps a layer inside "
                                                      "its parent (wrap it: nn.Sequential(layer))"))
            continue
        dims = {"in_features": module.in_features, "out_features": module.out_features}
        out.append(plan.decide_fp8(path, "linear", type_names(module), dims))
    return out


@dataclass
class Fp8Binding:
    """The FP8 layers of one applied model: decisions, the swapped paths and the originals."""

    decisions: list[Fp8Decision]
    layers: dict[str, str] = field(default_factory=dict)  # path -> recipe
    originals: dict[str, tuple[nn.Module, str, nn.Module]] = field(default_factory=dict)


def convert(plan: Plan, model: nn.Module, device: str, fsdp: bool = False) -> tuple[Fp8Binding, Callable[[], None]]:
    """Swap the Plan's FP8 layers of ``model`` for torchao ``Float8Linear``; returns the binding and the undo."""
    float8 = _import_float8()
    binding = Fp8Binding(decisions(plan, model))
    chosen = {d.path: d.recipe for d in binding.decisions if d.fp8 and d.recipe is not None}  # fp8: a recipe
    done = {p for p, m in model.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)}
    for path in set(chosen) - done:  # `done`: converted before sharding (unimp_torch.fully_shard), kept
        parent, _, name = path.rpartition(".")
        owner = model.get_submodule(parent)
        binding.originals[path] = (owner, name, getattr(owner, name))
    hooks: list[Any] = []

    def undo() -> None:
        for h in hooks:
            h.remove()
        for owner, name, original in binding.originals.values():
            setattr(owner, name, original)

    if not chosen:
        return binding, undo
    todo = set(chosen) - done
    if todo:
        float8.convert_to_float8_training(model, config=config(plan, device, fsdp),
                                          module_filter_fn=lambda module, fqn: fqn in todo)
    swapped = {p for p, m in model.named_modules() if isinstance(m, float8.float8_linear.Float8Linear)}
    if swapped != set(chosen):
        undo()
        raise UnsupportedError(f"torchao converted {sorted(swapped)} where the Plan chose {sorted(chosen)}; "
                               f"this torchao ({_torchao_version()}) is not the one unimp-torch supports "
                               f"({TORCHAO})")
    if device == "cpu" and plan.compute_dtype in ("bfloat16", "float16"):
        # torchao casts a Float8Linear's input to the *CUDA* autocast dtype only (on CPU it would stay float32 next
        # to low-precision gradients): cast it to the compute dtype, as torchao does under CUDA autocast.
        low = DTYPES[plan.compute_dtype]
        for path in chosen:
            hooks.append(model.get_submodule(path).register_forward_pre_hook(_cast_input(low)))
    binding.layers = dict(chosen)
    return binding, undo


def _cast_input(dtype: torch.dtype) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Any, ...]]:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_autocast_enabled("cpu"):
            return (x.to(dtype), *args[1:])
        return args

    return hook
