"""The canonical op vocabulary, and the helpers backends map their native names with — data, not code.

A canonical op is a framework-neutral class of operations. Each backend declares its own native
names per canonical op (``Backend.native_ops``, checked by :func:`native_table`) and finds a layer's
op with :func:`kind_of_names` over :func:`class_names`; nothing in this module imports a framework.

>>> OPS["matmul"].meaning
'matrix products (mm, bmm, einsum, @)'
>>> "linear" in CANONICAL_OPS
True
>>> suggest("matmull", CANONICAL_OPS)
'matmul'
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OpInfo:
    """One canonical op and what it means (each backend maps it to native names: ``Backend.native_ops``)."""

    name: str
    meaning: str


_OPS: tuple[OpInfo, ...] = (
    OpInfo("matmul", "matrix products (mm, bmm, einsum, @)"),
    OpInfo("linear", "fully connected layers (x @ W + b)"),
    OpInfo("conv", "convolutions and transposed convolutions"),
    OpInfo("attention", "scaled dot-product / multi-head attention"),
    OpInfo("rnn", "recurrent cells and layers"),
    OpInfo("embedding", "table lookups"),
    OpInfo("softmax", "softmax and softmin"),
    OpInfo("log_softmax", "log of softmax"),
    OpInfo("layer_norm", "layer normalisation"),
    OpInfo("rms_norm", "RMS normalisation"),
    OpInfo("batch_norm", "batch normalisation (in `float32`: fp32 params, statistics and math; the output "
                         "keeps the activation dtype, as torch and Keras run it)"),
    OpInfo("group_norm", "group / instance normalisation"),
    OpInfo("activation", "pointwise activations (relu, gelu, silu, tanh, sigmoid, prelu)"),
    OpInfo("transcendental", "exp, log, pow, rsqrt, trigonometric and friends"),
    OpInfo("reduction", "sums, means, cumulative ops and norms (windowed pooling follows its inputs)"),
    OpInfo("loss", "loss functions"),
    OpInfo("elementwise", "binary pointwise arithmetic (add, mul, addcmul, atan2, ...)"),
    OpInfo("concat", "concatenation and stacking"),
)

OPS: dict[str, OpInfo] = {op.name: op for op in _OPS}
CANONICAL_OPS: tuple[str, ...] = tuple(OPS)
OP_LISTS = ("lower", "float32", "promote")


def suggest(word: str, choices: Iterable[str]) -> str | None:
    """The closest valid name to a misspelt one, or None."""
    found = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


NativeTable = Mapping[str, tuple[str, ...]]  # canonical op -> a framework's native names for it


def native_table(backend: str, names: Mapping[str, Iterable[str]]) -> dict[str, tuple[str, ...]]:
    """Check a backend's native op-name table (canonical op -> native names) and freeze it.

    >>> native_table("demo", {"matmul": ["MatMul"]})["matmul"]
    ('MatMul',)
    """
    bad = [op for op in names if op not in OPS]
    if bad:
        hints = [f"{op!r}" + (f" (did you mean {s!r}?)" if (s := suggest(op, CANONICAL_OPS)) else "") for op in bad]
        raise ValueError(f"backend {backend}: native op table names unknown canonical ops: {', '.join(hints)}; "
                         f"the canonical ops are: {', '.join(CANONICAL_OPS)}")
    return {op: tuple(names.get(op, ())) for op in CANONICAL_OPS}


def kind_of(native_name: str, table: NativeTable) -> str | None:
    """The canonical op ``native_name`` belongs to in a backend's native table (first match).

    >>> kind_of("Dense", {"linear": ("Dense",)})
    'linear'
    """
    return next((op for op, names in table.items() if native_name in names), None)


def class_names(cls: type, stop: Iterable[type] = ()) -> tuple[str, ...]:
    """``cls`` and its bases, most specific first, up to the first class in ``stop`` (or ``object``).

    >>> class Base: ...
    >>> class Mine(Base): ...
    >>> class_names(Mine)
    ('Mine', 'Base')
    """
    ends = (*tuple(stop), object)
    out = []
    for c in cls.__mro__:
        if c in ends:
            break
        out.append(c.__name__)
    return tuple(out)


def kind_of_names(names: Iterable[str], table: NativeTable) -> str | None:
    """The canonical op of the first name (most specific class first) the table knows: the
    class -> op walk every backend shares (a subclass of ``Dense`` is a ``linear``).

    >>> kind_of_names(("MyDense", "Dense"), {"linear": ("Dense",)})
    'linear'
    """
    for name in names:
        k = kind_of(name, table)
        if k:
            return k
    return None
