"""``torch.optim.swa_utils.AveragedModel`` (and timm's EMAs) of a model with fp32 masters average the masters.

Under a policy with master weights, ``model.parameters()`` are the rounded low-precision copies. torch's global
module-registration hook (``register_module_module_registration_hook``) sees ``AveragedModel.__init__`` assign
``self.module = deepcopy(model)``: for a copy of an applied model that ``AveragedModel`` gets fp32 parameters and
an instance ``update_parameters`` (:class:`FromMasters`) that runs inside ``amp.masters_in_model()``. No torch
class is patched. One built *before* ``apply`` is found too (remembered weakly since the hook is on, else by one
walk of the garbage collector's objects at the first ``apply`` with masters) when its copy has this model's class,
parameter names and shapes. timm's ``ModelEmaV2``/``ModelEmaV3`` average ``state_dict()`` (the masters while
applied); one built after ``apply`` gets fp32 parameters holding the masters, so the EMA stays float32 (timm is
not imported: known by class module and name).

>>> import torch, unimp
>>> from torch.optim.swa_utils import AveragedModel
>>> m = torch.nn.Linear(2, 2)
>>> amp = unimp.apply("pure_bf16", m, torch.optim.SGD(m.parameters(), lr=0.1))
>>> ema = AveragedModel(m); ema.update_parameters(m)
>>> ema.module.weight.dtype, torch.equal(ema.module.weight, amp.master_weights[0][2])
(torch.float32, True)
>>> _ = amp.remove()
>>> before = AveragedModel(m)  # built before apply
>>> amp = unimp.apply("pure_bf16", m, torch.optim.SGD(m.parameters(), lr=0.1))
>>> before.update_parameters(m); torch.equal(before.module.weight, amp.master_weights[0][2])
True
>>> _ = amp.remove()
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.optim.swa_utils import AveragedModel

from ..forward import PolicyForward

_amps: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()  # module -> weakref to its Amp
_hook: list[Any] = []
_averaged: weakref.WeakSet[AveragedModel] = weakref.WeakSet()  # every AveragedModel seen (built or found)


def _amp_of(model: nn.Module) -> Any:
    ref = _amps.get(model)
    amp = ref() if ref is not None else None
    return amp if amp is not None and amp.params.swapped else None


def track(amp: Any) -> Callable[[], None]:
    """Let an ``AveragedModel`` of ``amp.module`` (or of a copy of it) average the masters; returns the undo."""
    if not amp.params.swapped:
        return lambda: None
    if not _hook:
        _hook.append(register_module_module_registration_hook(_registered))
        # those built before the hook was on: once per process (type() only: no attribute of a foreign object read)
        _averaged.update(o for o in gc.get_objects() if issubclass(type(o), AveragedModel))
    _amps[amp.module] = weakref.ref(amp)
    shape = _shape(amp.module)
    for averaged in list(_averaged):  # built before apply: a copy of this model's architecture
        copy = averaged.__dict__.get("_modules", {}).get("module")
        if copy is not None and type(copy) is type(amp.module) and _shape(copy) == shape:
            _from_masters(averaged)
    return lambda: _amps.pop(amp.module, None)


def _shape(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


TIMM_EMAS = frozenset({"ModelEmaV2", "ModelEmaV3"})  # timm.utils.model_ema's, averaging model.state_dict()


def _registered(parent: nn.Module, name: str, value: Any) -> None:
    if name != "module":
        return
    if isinstance(parent, AveragedModel):
        _averaged.add(parent)
        if isinstance(value.__dict__.get("forward"), PolicyForward):  # a copy of a model with a policy applied
            _from_masters(parent)
    elif (type(parent).__name__ in TIMM_EMAS and type(parent).__module__.startswith("timm.")
          and isinstance(value.__dict__.get("forward"), PolicyForward)):
        amp = _copied_from(value)
        if amp is not None:
            _full_precision_slots(value, amp, masters=True)


def _copied_from(copy: nn.Module) -> Any:
    """The live Amp with masters whose model ``copy`` was just copied from: the same class, every parameter
    equal bit for bit (None if there is none)."""
    params = list(copy.parameters())
    for module, ref in list(_amps.items()):
        amp = ref()
        if amp is None or not amp.params.swapped or type(module) is not type(copy):
            continue
        theirs = list(module.parameters())
        if len(theirs) == len(params) and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                                              for a, b in zip(theirs, params, strict=True)):
            return amp
    return None


def _from_masters(averaged: AveragedModel) -> None:
    if not isinstance(averaged.__dict__.get("update_parameters"), FromMasters):
        averaged.__dict__["update_parameters"] = FromMasters(averaged)


class FromMasters:
    """An ``AveragedModel``'s ``update_parameters`` for a copy of an applied model: the averaged parameters
    become fp32 (once), and the class's ``update_parameters`` runs inside ``amp.masters_in_model()``."""

    def __init__(self, averaged: AveragedModel) -> None:
        self.averaged = averaged
        self.widened: Any = None  # a weakref to the Amp whose slots the averaged copy already holds in fp32

    def __call__(self, model: nn.Module) -> None:
        update = type(self.averaged).update_parameters
        amp = _amp_of(model)
        if amp is None:
            return update(self.averaged, model)
        if self.widened is None or self.widened() is not amp:  # once per Amp, not every step
            _full_precision_slots(self.averaged.module, amp)
            self.widened = weakref.ref(amp)
        with amp.masters_in_model():
            return update(self.averaged, model)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its AveragedModel (torch.save(ema)): no weakref
        return FromMasters, (self.averaged,)


def _full_precision_slots(copy: nn.Module, amp: Any, masters: bool = False) -> None:
    """The copy's parameters in the slots of ``amp``'s low-precision copies get the fp32 dtype (ties kept):
    their own values widened, or (``masters``) the masters' values."""
    paths = {id(m): p for p, m in amp.module.named_modules(remove_duplicate=False)}
    made: dict[int, nn.Parameter] = {}
    for module, name, original, _ in amp.params.swapped:
        owner = copy.get_submodule(paths[id(module)])
        p = owner._parameters.get(name)
        if p is None or p.dtype == original.dtype:
            continue
        if id(original) not in made:
            value = original.detach().clone() if masters else p.detach().to(original.dtype)
            made[id(original)] = nn.Parameter(value.to(p.device), requires_grad=p.requires_grad)
        owner._parameters[name] = made[id(original)]
