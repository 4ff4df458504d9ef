"""The request (the policy as asked) -> the JAX backend's Plan: what Flax controls, per layer and op.

Every layer kind and the JAX functions (through :class:`unimp_jax.Op`) are controlled per layer;
``elementwise``/``concat`` follow JAX type promotion. An nnx model given at compile is indexed
(:func:`unimp_jax.index.model_index`): the Plan carries its per-layer table and layout findings (a linen
Module is indexed when bound: it creates its layers only while calling).

>>> import unimp
>>> from unimp.spi import Plan
>>> plan = compile_plan(Plan.request(unimp.load("mixed_bf16"), "jax"))
>>> plan.op("linear").control, plan.op("concat").control, plan.details.platform
('layer', 'fixed', 'cpu')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from unimp.spi import Fp8Support, LossScale, Plan, PlanRequest, ops

from .layers import is_nnx
from .ops import NATIVE_OPS

LAYER_OPS = ("matmul", "linear", "conv", "attention", "rnn", "embedding", "layer_norm", "rms_norm",
             "batch_norm", "group_norm")
FUNCTION_OPS = ("activation", "softmax", "log_softmax", "transcendental", "reduction", "loss")
PROMOTION = "JAX type promotion: the widest input dtype (bfloat16 + float32 -> float32)"
NOTES = (
    "Flax controls dtypes per layer: Linear/Dense, Einsum, Conv, Embed, the norms, attention and RNN "
    "cells run in the policy's dtype for their kind, path and type",
    "activation, softmax, log_softmax, transcendental, reduction, loss are JAX functions: the policy "
    "controls them inside Flax layers and where wrapped as layers (unimp_jax.Op / unimp_jax.LinenOp); "
    "called bare in your code they run in their inputs' dtype (a loss on the model's output runs in "
    "output_dtype; with output_dtype \"unchanged\" in the last layer's dtype: cast the logits to float32 first)",
    "softmax inside attention: linen MultiHeadDotProductAttention gets force_fp32_for_softmax when the "
    "policy lists softmax as float32; nnx MultiHeadAttention computes it in the layer's dtype (Flax decides)",
    "layout.channels_last: not applicable on XLA (the compiler picks layouts; Flax convs are NHWC already)",
    "distributed.reduce_dtype: honoured inside shard_map/pmap through amp.value_and_grad(loss_fn, "
    "axis_name=...) or amp.data_parallel(step): gradients all-reduced in reduce_dtype, finiteness agreed by "
    "every device; a plain jit over NamedSharding inputs lets XLA's partitioner reduce in the dtype it "
    "meets (often the compute dtype)",
)


@dataclass(frozen=True)
class JaxDetails:
    """What the jax backend decided at compile time (``plan.details``)."""

    platform: str  # cpu | gpu | tpu
    master_weights: bool
    slow_dtype_warning: str | None  # the warning apply gives for a dtype slower than float32 here


def fp8_support(platform: str) -> Fp8Support:
    """What this backend runs in FP8 on ``platform``."""
    notes: tuple[str, ...] = (
        "Flax Linear/Dense layers chosen by the Plan get a scaled FP8 dot_general for their call; "
        "XLA lowers FP8 dots to cuBLASLt FP8 GEMMs on Hopper+ GPUs",)
    if platform != "gpu":
        notes += (f"XLA:{platform.upper()} has no FP8 units: the FP8 dots are emulated (numerics as on the "
                  f"GPU, slower than the compute dtype)",)
    return Fp8Support(ops=("linear",),
                      recipes={"delayed": "scaled FP8 dot_general, amax-history scales (flax.linen.fp8_ops rule)",
                               "tensorwise": "scaled FP8 dot_general, scales from this step's amax",
                               "rowwise": "scaled FP8 dot_general, per-row power-of-2 scales from this step's "
                                          "amax (torchao's rowwise)",
                               "rowwise_gw_hp": "scaled FP8 dot_general, per-row scales; grad-weight GEMM in the "
                                                "compute dtype (torchao's rowwise_with_gw_hp)"},
                      gradient_formats=("e5m2", "e4m3"), notes=notes)


def compile_plan(request: PlanRequest, model: Any = None) -> Plan:
    """The Plan on the device of ``model``'s arrays (else JAX's default device), indexed when ``model``
    is an nnx Module. Loss-scale knobs this device cannot reproduce are refused or run as noted."""
    from .hardware import platform_of, resolve
    from .index import model_index
    from .scaler import stops_below_tiny, subnormal_note, unsupported

    tree = None
    if is_nnx(model):
        from flax import nnx

        tree = nnx.state(model)
    platform, capability = platform_of(tree)
    dtype, reason, warning = resolve(request.compute_dtype, platform, capability)
    request = request.at(dtype)
    spec = request.loss_scale
    knobs = unsupported(spec)
    run = LossScale(spec).as_run(knobs)
    control = {op: "layer" for op in (*LAYER_OPS, *FUNCTION_OPS)}
    native = {op: NATIVE_OPS.get(op, ()) + (("unimp_jax.Op",) if op in FUNCTION_OPS else ())
              for op in ops.CANONICAL_OPS}
    notes = (*NOTES, *((warning,) if warning else ()), *((subnormal_note(run),) if stops_below_tiny(run) else ()))
    return request.compile(control=control, native=native, compute_reason=reason,
                           fixed={op: (None, PROMOTION) for op in ("elementwise", "concat")}, notes=notes,
                           details=JaxDetails(platform, request.uses_master_weights, warning),
                           index=model_index(model) if is_nnx(model) else None,
                           fp8=fp8_support(platform), loss_scale_unsupported=knobs)
