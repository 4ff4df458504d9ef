"""Canonical op lists compiled to Paddle's native op-type lists (pure data, no paddle import).

Paddle names ops natively (``matmul_v2``, ``layer_norm`` ...), so unimp's ``lower`` list becomes
Paddle's white list, ``float32`` its black list, and ``promote``/follow-inputs ops its gray set
(neither list). Names come from the backend's table :data:`NATIVE_OPS` (lower-case entries are op
types; capitalised entries are layer classes); it is the table the core's Paddle importer reads too.

>>> import unimp
>>> lists = compile_lists(unimp.load("mixed_bf16"))
>>> "matmul_v2" in lists.white, "layer_norm" in lists.black, "elementwise_add" in lists.gray
(True, True, True)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from unimp.spi import CANONICAL_OPS, PADDLE_NATIVE_OPS, Policy

NATIVE_OPS: dict[str, tuple[str, ...]] = dict(PADDLE_NATIVE_OPS)  # the core's Paddle importer reads it too


def op_types(op: str) -> frozenset[str]:
    """Paddle op types of one canonical op (its lower-case native names)."""
    return frozenset(n for n in NATIVE_OPS.get(op, ()) if n[:1].islower())


def layer_types(op: str) -> frozenset[str]:
    """Paddle layer classes of one canonical op (its capitalised native names)."""
    return frozenset(n for n in NATIVE_OPS.get(op, ()) if n[:1].isupper())


ALL_CANONICAL_TYPES: frozenset[str] = frozenset().union(*(op_types(o) for o in CANONICAL_OPS))


@dataclass(frozen=True)
class OpLists:
    """Native op types by what the policy asks: white (low), black (float32), gray (inputs/promote)."""

    white: frozenset[str]
    black: frozenset[str]
    gray: frozenset[str]

    def exact(self, default_white: Iterable[str], default_black: Iterable[str]) -> tuple[set[str], set[str]]:
        """Paddle's full lists: its defaults for non-canonical ops, the policy for canonical ones."""
        white = (set(default_white) - ALL_CANONICAL_TYPES) | set(self.white)
        black = (set(default_black) - ALL_CANONICAL_TYPES) | set(self.black)
        return white, black

    def moved(self, kind: str, dtype: str | None) -> OpLists:
        """These lists with the op types of canonical ``kind`` moved to run in ``dtype``."""
        names = op_types(kind)
        white, black, gray = self.white - names, self.black - names, self.gray - names
        if dtype is None:
            gray |= names
        elif dtype == "float32":
            black |= names
        else:
            white |= names
        return OpLists(frozenset(white), frozenset(black), frozenset(gray))


def compile_lists(policy: Policy) -> OpLists:
    """White/black/gray Paddle op types for the policy's canonical op lists."""
    white: set[str] = set()
    black: set[str] = set()
    gray: set[str] = set()
    for op in CANONICAL_OPS:
        category = policy.ops.category(op)
        target = {"lower": white, "float32": black}.get(category, gray)
        target |= op_types(op)
    # a native type shared by two canonical ops keeps the stricter placement: float32 > low > gray
    white -= black
    gray -= black | white
    return OpLists(frozenset(white), frozenset(black), frozenset(gray))
