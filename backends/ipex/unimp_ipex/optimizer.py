"""The optimizer role: ``ipex.optimize`` on a copy of the user's model and optimizer, the masters IPEX keeps,
and the write-back. The wrapper ``amp.optimizer`` (unscale, skip, masters) is unimp-torch's ``AmpOptimizer``.

IPEX (``inplace=False``, its default) deep-copies the model and the optimizer; the user's objects
are never modified. Training runs on the copy; ``write_back`` copies the trained values (the fp32
masters where IPEX keeps them) into the user's parameters and buffers, in their own dtypes.

>>> import torch
>>> m = torch.nn.Linear(4, 4)
>>> copy, opt = optimize(m, torch.optim.SGD(m.parameters(), lr=0.1), {"dtype": torch.float32})
>>> copy is m, m.weight.dtype
(False, torch.float32)
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

import torch
from torch import nn

from unimp_torch.extension import AmpOptimizer as AmpOptimizer

IPEX_INTERNAL = "_ipex_module_empty_"  # placeholder params IPEX adds to prepacked modules


def optimize(model: nn.Module, optimizer: torch.optim.Optimizer | None, kwargs: dict[str, Any]
             ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """``ipex.optimize(model, optimizer=..., **kwargs)`` with IPEX's deprecation chatter muted.

    IPEX converts the *user's* conv weights to channels_last before it copies the model (its
    ``auto_channels_last``, even with ``inplace=False``); the original tensors are put back.
    """
    import intel_extension_for_pytorch as ipex

    kept = [(p, p.data) for p in model.parameters()]
    quiet = logging.getLogger("IPEX")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            out = ipex.optimize(model, optimizer=optimizer, **kwargs)
    except AssertionError as e:  # IPEX's own CPU checks (hardware.py decides before; this is the backstop)
        from unimp.spi import UnsupportedError, hardware

        raise UnsupportedError(f"ipex.optimize({', '.join(f'{k}={v}' for k, v in kwargs.items())}) refused this "
                               f"CPU ({hardware.cpu().describe()}): {e}. Pass engine='torch' to unimp.apply, or set "
                               f"compute_dtype = \"auto\" (float32 where bf16 is not native)") from None
    finally:
        quiet.setLevel(level)
        for p, data in kept:
            p.data = data
    return out if isinstance(out, tuple) else (out, None)


def ipex_masters(model: nn.Module, optimizer: Any) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """``(name, bf16 param, fp32 master)`` for the params whose masters IPEX's optimizer holds."""
    attrs = getattr(optimizer, "params_attr", None) or {}
    by_param = {id(a.parameter): master for master, a in attrs.items()
                if a.parameter is not None and a.parameter is not master}
    return [(n, p, by_param[id(p)]) for n, p in model.named_parameters() if id(p) in by_param]


def param_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {n: p.dtype for n, p in model.named_parameters() if IPEX_INTERNAL not in n}


def write_back(original: nn.Module, trained: nn.Module) -> None:
    """Trained values of ``trained`` (IPEX's unpacked fp32 ``state_dict``) into ``original``, in place."""
    values = trained.state_dict()
    with torch.no_grad():
        for name, t in (*original.named_parameters(), *original.named_buffers()):
            if name in values:
                t.copy_(values[name].to(t.dtype))
