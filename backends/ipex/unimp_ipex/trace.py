"""What ran: unimp-torch's trace of one real forward of IPEX's copy, its rows named by the user's layers
(IPEX renames the classes it converts, e.g. ``_IPEXLinear``; the report keeps the user's kinds)."""

import dataclasses

from torch import nn

from unimp.spi import ReportRow
from unimp_torch.extension import kind


def user_rows(rows: tuple[ReportRow, ...], original: nn.Module) -> list[ReportRow]:
    """``rows`` (unimp-torch's report of the optimized copy) with each layer's kind from ``original``."""
    out = []
    for r in rows:
        try:
            k = kind(original.get_submodule("" if r.path == "<model>" else r.path))
        except AttributeError:
            k = r.kind
        out.append(dataclasses.replace(r, kind=k or r.kind))
    return out
