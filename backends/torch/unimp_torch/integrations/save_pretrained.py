"""``model.save_pretrained(d)`` while a policy with low-precision parameters is applied saves the
full-precision model: the fp32 masters (and fp32 originals of frozen parameters), and a config
whose ``dtype`` is theirs, so ``from_pretrained(d)`` returns them.

An applied model whose class has a ``save_pretrained`` method (HF, ``push_to_hub``, the Trainer's checkpoints)
gets one on the instance that runs the class's inside ``amp.masters_in_model()``; ``amp.remove()`` takes it away,
and copies and pickles of the model get the class's method back.

>>> import torch, unimp
>>> class Saving(torch.nn.Linear):
...     def save_pretrained(self, d):
...         return self.weight.dtype
>>> m = Saving(2, 2)
>>> amp = unimp.apply("pure_bf16", m, torch.optim.SGD(m.parameters(), lr=0.1))
>>> m.weight.dtype, m.save_pretrained("d")
(torch.bfloat16, torch.float32)
>>> _ = amp.remove(); "save_pretrained" in m.__dict__
False
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn


class FullPrecisionSave:
    """The instance's ``save_pretrained``: the class's, run with the fp32 originals in the model."""

    def __init__(self, module: nn.Module, amp: Any) -> None:
        self.module = module
        self.amp = weakref.ref(amp) if amp is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        save = functools.partial(type(self.module).save_pretrained, self.module)
        amp = self.amp() if self.amp is not None else None
        if amp is None:
            return save(*args, **kwargs)
        with amp.masters_in_model():
            return save(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:  # a copy saves its own weights
        return (FullPrecisionSave, (self.module, None))


def save_full_precision(amp: Any, model: nn.Module) -> Callable[[], None]:
    """Give ``model`` a full-precision ``save_pretrained`` when it has low-precision copies and
    its class has the method; returns the undo."""
    if not amp.params.swapped or not callable(getattr(type(model), "save_pretrained", None)) \
            or "save_pretrained" in model.__dict__:
        return lambda: None
    model.__dict__["save_pretrained"] = FullPrecisionSave(model, amp)

    def undo() -> None:
        model.__dict__.pop("save_pretrained", None)

    return undo
