"""The canonical kind of a module: torch's own layers by the op vocabulary, third-party ones here.

Model libraries' layers are listed by qualified class name (HF ``LlamaRMSNorm``, GPT-2's ``Conv1D`` is a linear,
``T5LayerNorm`` an RMS norm); beyond the list, a leaf named ``...RMSNorm``/``...LayerNorm`` with a 1-D ``weight``
is recognised. A module with children never gets a kind from here (kinds belong to leaf layers).

>>> import torch
>>> class MyRMSNorm(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.weight = torch.nn.Parameter(torch.ones(8))
>>> extra_kind(MyRMSNorm())
'rms_norm'
>>> extra_kind(torch.nn.Sequential(MyRMSNorm())) is None
True
"""

from __future__ import annotations

from torch import nn

from unimp.spi import ops

from .ops import NATIVE_OPS

_HF = "transformers.models"
_RMS_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
                 "gemma2", "gemma3", "phi3", "olmo2", "granite", "deepseek_v3")


def _rms_name(family: str) -> str:
    camel = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmo2": "Olmo2",
             "deepseek_v3": "DeepseekV3"}.get(family, family.capitalize())
    return f"{_HF}.{family}.modeling_{family}.{camel}RMSNorm"


# qualified class name -> canonical op (the vocabulary of unimp.policy.ops)
REGISTRY: dict[str, str] = {
    "transformers.pytorch_utils.Conv1D": "linear",
    **{_rms_name(f): "rms_norm" for f in _RMS_FAMILIES},
    f"{_HF}.t5.modeling_t5.T5LayerNorm": "rms_norm",
    f"{_HF}.mt5.modeling_mt5.MT5LayerNorm": "rms_norm",
    f"{_HF}.longt5.modeling_longt5.LongT5LayerNorm": "rms_norm",
    "timm.layers.norm.LayerNorm2d": "layer_norm",
    "timm.layers.norm.RmsNorm": "rms_norm",
    "timm.layers.norm.RmsNorm2d": "rms_norm",
}


def type_names(module: nn.Module) -> tuple[str, ...]:
    """Class names of ``module`` and its bases up to ``nn.Module`` (for kinds and overrides)."""
    return ops.class_names(type(module), stop=(nn.Module,))


def kind(module: nn.Module) -> str | None:
    """The canonical op of a layer (``Linear`` -> ``linear``; subclasses count as their base;
    third-party leaf layers such as HF ``LlamaRMSNorm`` through :func:`extra_kind`)."""
    return ops.kind_of_names(type_names(module), NATIVE_OPS) or extra_kind(module)


def qualified(cls: type) -> str:
    """``module.QualName`` of a class (the key of :data:`REGISTRY`)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _structural(module: nn.Module, name: str) -> str | None:
    weight = getattr(module, "weight", None)
    one_d = weight is None or (isinstance(weight, nn.Parameter) and weight.dim() == 1)
    if not one_d:
        return None
    if name.endswith(("RMSNorm", "RmsNorm")):
        return "rms_norm"
    if name.endswith("LayerNorm"):
        return "layer_norm"
    return None


def extra_kind(module: nn.Module) -> str | None:
    """The kind of a leaf ``module`` whose class (or a base) torch does not name, else None."""
    if next(iter(module.children()), None) is not None:
        return None
    mro = [c for c in type(module).__mro__ if c not in (nn.Module, object)]
    for cls in mro:
        k = REGISTRY.get(qualified(cls))
        if k:
            return k
    for cls in mro:
        k = _structural(module, cls.__name__)
        if k:
            return k
    return None


def report_kind(module: nn.Module) -> str | None:
    """A report-only label for a module with no kind: ``attention`` for an attention block (a class
    named ``...Attention``, as HF's and timm's are). It changes no decision: attention blocks are
    composite, their projections and softmax keep their own kinds.

    >>> report_kind(nn.Module()) is None
    True
    """
    if any(c.__name__.endswith("Attention") for c in type(module).__mro__ if c not in (nn.Module, object)):
        return "attention"
    return None
