"""Alignment findings and the one ``layout.on_misaligned`` action (ignore / warn / error) every backend runs.

A backend lists each layer's tiling dims (``("out_features", 12)``) in its model index; the core
turns them into findings and acts on them the same way everywhere.

>>> import unimp
>>> found = misaligned([("fc", (("in_features", 16), ("out_features", 12)))], 8)
>>> found
('fc: out_features=12 is not a multiple of 8',)
>>> LayoutFindings(8, "ignore", found).act("demo")
()
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from unimp.errors import UnimpWarning, UnsupportedError
from unimp.policy import Layout

ACTIONS = ("ignore", "warn", "error")


def misaligned(layers: Iterable[tuple[str, Iterable[tuple[str, int]]]], align: int) -> tuple[str, ...]:
    """``"path: dim=value is not a multiple of align"`` per dim of ``(path, ((dim, value), ...))``."""
    if align <= 1:
        return ()
    return tuple(f"{path or '<model>'}: {name}={int(n)} is not a multiple of {align}"
                 for path, dims in layers for name, n in dims if int(n) % align)


@dataclass(frozen=True)
class LayoutFindings:
    """Dims not a multiple of ``align`` (with their paths) and what ``on_misaligned`` does with them."""

    align: int
    action: str
    findings: tuple[str, ...] = ()

    @classmethod
    def check(cls, layers: Iterable[tuple[str, Iterable[tuple[str, int]]]], layout: Layout) -> LayoutFindings:
        """The findings of ``(path, ((dim, value), ...))`` pairs under a policy's ``layout`` table."""
        return cls(layout.align, layout.on_misaligned, misaligned(layers, layout.align))

    def act(self, backend: str, *, stacklevel: int = 4) -> tuple[str, ...]:
        """Apply the action: ``error`` raises :class:`UnsupportedError` naming every path, ``warn`` warns
        (:class:`UnimpWarning`); returns the findings to keep in ``amp.findings`` (none for ``ignore``)."""
        if not self.findings or self.action == "ignore":
            return ()
        if self.action == "error":
            raise UnsupportedError(
                f"layout.on_misaligned = 'error' ({backend}): {len(self.findings)} dims are not multiples of "
                f"layout.align={self.align}:\n  " + "\n  ".join(self.findings)
                + "\nfix: pad these dims to a multiple of layout.align, lower layout.align, or set "
                  "layout.on_misaligned = 'warn' or 'ignore'")
        warnings.warn(f"unimp ({backend}): dims not a multiple of layout.align={self.align} (slower "
                      f"tensor-core paths): " + "; ".join(self.findings), UnimpWarning, stacklevel=stacklevel)
        return self.findings
