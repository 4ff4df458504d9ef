"""Which engine runs a torch CPU model: IPEX 2.8 (where it can be imported) or torch's CPU autocast.

Found from package metadata, without importing IPEX (its import takes seconds, patches torch's
AutocastCPU kernels process-wide and exits the process when the torch minor does not match).

>>> find_engine("torch").name
'torch'
>>> find_engine("nope")
Traceback (most recent call last):
...
ValueError: engine: expected 'auto', 'ipex' or 'torch', got 'nope'
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from unimp.spi import UnsupportedError

ENGINES = ("auto", "ipex", "torch")
IPEX_DIST = "intel-extension-for-pytorch"
INSTALL = "pip install 'unimp-ipex[ipex]' (intel-extension-for-pytorch 2.8.0 with torch 2.8)"


@dataclass(frozen=True)
class Engine:
    """``name`` is ``ipex`` or ``torch``; ``reason`` says why it was chosen."""

    name: str
    reason: str
    ipex_version: str | None = None


def _minor(v: str) -> tuple[str, ...]:
    return tuple(v.split("+")[0].split(".")[:2])


def ipex_status() -> tuple[str | None, str]:
    """(IPEX version when it can be imported with this torch, else None; why)."""
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return None, "intel_extension_for_pytorch is not installed"
    try:
        ipex_v, torch_v = version(IPEX_DIST), version("torch")
    except PackageNotFoundError as e:
        return None, f"cannot read the version of {e.name}"
    if _minor(ipex_v) != _minor(torch_v):
        return None, (f"intel-extension-for-pytorch {ipex_v} needs torch {'.'.join(_minor(ipex_v))}.*, "
                      f"this is torch {torch_v} (IPEX would exit at import)")
    return ipex_v, f"intel-extension-for-pytorch {ipex_v} is installed for torch {torch_v}"


def find_engine(requested: str = "auto") -> Engine:
    """The engine for ``requested`` (``auto``: IPEX when usable, else torch); clear errors otherwise."""
    if requested not in ENGINES:
        raise ValueError(f"engine: expected 'auto', 'ipex' or 'torch', got {requested!r}")
    if requested == "torch":
        return Engine("torch", "engine='torch' requested: torch CPU autocast (oneDNN)")
    ipex_v, why = ipex_status()
    if ipex_v is not None:
        return Engine("ipex", why, ipex_v)
    if requested == "ipex":
        raise UnsupportedError(f"engine='ipex' requested but {why}; {INSTALL}, or pass engine='torch'")
    return Engine("torch", f"{why}: running torch CPU autocast (oneDNN) instead")
