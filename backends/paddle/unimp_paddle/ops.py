"""Paddle's op names per canonical op, and the policy's op lists as Paddle's lists (pure data, no paddle import).

Paddle names ops natively (``matmul_v2``, ``layer_norm`` ...), so unimp's ``lower`` list becomes
Paddle's white list, ``float32`` its black list, and ``promote``/follow-inputs ops its gray set
(neither list). Names come from :data:`NATIVE_OPS` (lower-case entries are op types; capitalised
entries are layer classes).

>>> import unimp
>>> from unimp.spi import Plan
>>> lists = compile_lists(Plan.request(unimp.load("mixed_bf16"), "paddle"))
>>> "matmul_v2" in lists.white, "layer_norm" in lists.black, "elementwise_add" in lists.gray
(True, True, True)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from unimp.spi import Plan, PlanRequest
from unimp.spi import ops as core

# Paddle's names per canonical op (lower case: op types as in paddle.amp's white/black lists; capitalised:
# layer classes), from python/paddle/amp/amp_lists.py and python/paddle/static/amp/bf16/amp_lists.py. The
# backend's own table (``PaddleBackend.native_ops``); the core's Paddle importer reads it from here.
NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul", "matmul_v2", "mul", "einsum", "bmm", "fused_gemm_epilogue"),
    "linear": ("linear", "Linear"),
    "conv": ("conv2d", "conv3d", "conv2d_transpose", "depthwise_conv2d", "Conv1D", "Conv2D", "Conv3D",
        "Conv2DTranspose"),
    "attention": ("flash_attn", "scaled_dot_product_attention", "MultiHeadAttention"),
    "rnn": ("rnn", "lstm", "LSTM", "GRU", "SimpleRNN"),
    "embedding": ("lookup_table_v2", "embedding", "Embedding"),
    "softmax": ("softmax", "Softmax"),
    "log_softmax": ("log_softmax", "LogSoftmax"),
    "layer_norm": ("layer_norm", "LayerNorm"),
    "rms_norm": ("rms_norm", "RMSNorm"),
    "batch_norm": ("batch_norm", "sync_batch_norm", "BatchNorm", "BatchNorm1D", "BatchNorm2D", "BatchNorm3D"),
    "group_norm": ("group_norm", "instance_norm", "GroupNorm", "InstanceNorm2D"),
    "activation": ("relu", "gelu", "silu", "tanh", "sigmoid", "ReLU", "GELU", "Silu", "Tanh", "Sigmoid"),
    "transcendental": ("exp", "expm1", "log", "log10", "log2", "pow", "rsqrt", "reciprocal", "square", "acos",
        "asin", "sinh", "cosh", "atanh", "tan", "erfinv", "softplus"),
    "reduction": ("reduce_sum", "sum", "mean", "reduce_mean", "reduce_prod", "cumsum", "cumprod", "p_norm",
        "frobenius_norm", "dist", "renorm"),
    "loss": ("softmax_with_cross_entropy", "cross_entropy", "cross_entropy2",
        "sigmoid_cross_entropy_with_logits", "nll_loss", "huber_loss", "log_loss", "margin_cross_entropy",
        "c_softmax_with_cross_entropy", "mse_loss"),
    "elementwise": ("elementwise_add", "elementwise_sub", "elementwise_mul", "elementwise_div"),
    "concat": ("concat", "stack"),
}


def canonical_of(name: str) -> str | None:
    """The canonical op of a Paddle op type or layer class name (None: not in the table)."""
    return core.kind_of(name, NATIVE_OPS)


def op_types(op: str) -> frozenset[str]:
    """Paddle op types of one canonical op (its lower-case native names)."""
    return frozenset(n for n in NATIVE_OPS.get(op, ()) if n[:1].islower())


def layer_types(op: str) -> frozenset[str]:
    """Paddle layer classes of one canonical op (its capitalised native names)."""
    return frozenset(n for n in NATIVE_OPS.get(op, ()) if n[:1].isupper())


ALL_CANONICAL_TYPES: frozenset[str] = frozenset().union(*(op_types(o) for o in NATIVE_OPS))


@dataclass(frozen=True)
class OpLists:
    """Native op types by what the policy asks: white (low), black (float32), gray (inputs/promote)."""

    white: frozenset[str] = frozenset()  # OpLists(): none listed (a Plan compiled before its lists)
    black: frozenset[str] = frozenset()
    gray: frozenset[str] = frozenset()

    def exact(self, default_white: Iterable[str], default_black: Iterable[str]) -> tuple[set[str], set[str]]:
        """Paddle's full lists: its defaults for non-canonical ops, the policy for canonical ones."""
        white = (set(default_white) - ALL_CANONICAL_TYPES) | set(self.white)
        black = (set(default_black) - ALL_CANONICAL_TYPES) | set(self.black)
        return white, black

    def moved(self, kind: str | None, dtype: str | None) -> OpLists:
        """These lists with the op types of canonical ``kind`` moved to run in ``dtype``."""
        names = op_types(kind) if kind is not None else frozenset()
        white, black, gray = self.white - names, self.black - names, self.gray - names
        if dtype is None:
            gray |= names
        elif dtype == "float32":
            black |= names
        else:
            white |= names
        return OpLists(frozenset(white), frozenset(black), frozenset(gray))


def compile_lists(plan: Plan | PlanRequest) -> OpLists:
    """White/black/gray Paddle op types for the canonical op lists the Plan (or request) asks."""
    white: set[str] = set()
    black: set[str] = set()
    gray: set[str] = set()
    for d in plan.ops:
        target = {"lower": white, "float32": black}.get(d.requested, gray)
        target |= op_types(d.op)
    # a native type shared by two canonical ops keeps the stricter placement: float32 > low > gray
    white -= black
    gray -= black | white
    return OpLists(frozenset(white), frozenset(black), frozenset(gray))
