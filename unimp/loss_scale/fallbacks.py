"""What a backend does with the loss-scale knobs it cannot honour: refuse them or note what runs instead."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from unimp.errors import UnsupportedError
from unimp.policy.tables import LossScaleSpec


def loss_scale_fallbacks(spec: LossScaleSpec, unsupported: Mapping[str, tuple[Any, str]], where: str,
                         on_unsupported: str) -> list[str]:
    """Apply ``on_unsupported`` to the loss-scale knobs a backend cannot honour (``unsupported``:
    ``{knob: (what runs instead, why)}``): an :class:`UnsupportedError` naming each (``"error"``),
    else the Plan notes saying what runs instead.

    >>> import dataclasses, unimp
    >>> spec = dataclasses.replace(unimp.load("mixed_fp16").loss_scale, scale_dtype="float64")
    >>> loss_scale_fallbacks(spec, {"scale_dtype": ("float32", "no float64")}, "policy 'p'", "fallback")
    ["loss_scale.scale_dtype = 'float64' runs as 'float32': no float64"]
    """
    if unsupported and on_unsupported == "error":
        raise UnsupportedError(f"{where}: " + "; ".join(
            f"loss_scale.{k} = {getattr(spec, k)!r} cannot be honoured: {why}" for k, (_, why) in unsupported.items())
            + " (or on_unsupported = 'fallback')")
    return [f"loss_scale.{k} = {getattr(spec, k)!r} runs as {v!r}: {why}" for k, (v, why) in unsupported.items()]


def loss_scale_as_run(spec: LossScaleSpec, unsupported: Mapping[str, tuple[Any, str]]) -> LossScaleSpec:
    """``spec`` with each knob a backend cannot honour set to what it runs instead."""
    return dataclasses.replace(spec, **{k: v for k, (v, _) in unsupported.items()})
