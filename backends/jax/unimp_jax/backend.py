"""The JAX backend class (entry point ``unimp.backends: jax``); imports no framework at import.

>>> from unimp_jax.backend import JaxBackend
>>> JaxBackend.name, JaxBackend.framework
('jax', 'flax')
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

from unimp.spi import (
    CANONICAL_OPS,
    Amp,
    Backend,
    Fp8Support,
    Plan,
    Policy,
    Snapshot,
    UnimpWarning,
    compile_ops,
    native_table,
)

from .layers import is_linen, is_nnx
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


def fp8_support(platform: str) -> Any:
    """What this backend runs in FP8 (:class:`unimp.plan.fp8.Fp8Support`) on ``platform``."""
    notes = ("Flax Linear/Dense layers chosen by the Plan get a scaled FP8 dot_general for their call; "
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



class JaxBackend(Backend):
    """Flax nnx and linen Modules with optax optimizers."""

    name = "jax"
    framework = "flax"
    distribution = "unimp-jax"
    model_types = "flax.nnx.Module or flax.linen.Module (with an optax GradientTransformation)"
    native_ops: ClassVar = native_table("jax", NATIVE_OPS)
    tags: ClassVar = frozenset({"fp16", "bf16", "master_weights", "loss_scaling", "training", "overrides", "layout",
                                "layer_level", "distributed", "remove"})

    def accepts(self, model: Any) -> bool:
        return is_nnx(model) or is_linen(model)

    def compile(self, policy: Policy, model: Any = None) -> Plan:
        from .hardware import platform_of, resolve
        from .scaler import validate

        scale_notes = validate(policy.loss_scale, f"policy {policy.name!r} ({policy.source})", policy.on_unsupported)
        tree = None
        if is_nnx(model):
            from flax import nnx

            tree = nnx.state(model)
        platform, capability = platform_of(tree)
        dtype, reason, warning = resolve(policy.compute_dtype, platform, capability)
        control = {op: "layer" for op in (*LAYER_OPS, *FUNCTION_OPS)}
        native = {op: NATIVE_OPS.get(op, ()) + (("unimp_jax.Op",) if op in FUNCTION_OPS else ())
                  for op in CANONICAL_OPS}
        fixed = {op: (None, PROMOTION) for op in ("elementwise", "concat")}
        notes = (*NOTES, *((warning,) if warning else ()), *scale_notes)
        details = JaxDetails(platform, policy.uses_master_weights, warning)
        return compile_ops(self.name, policy, control=control, native=native, compute_dtype=dtype,
                           compute_reason=reason, fixed=fixed, notes=notes, details=details,
                           fp8=fp8_support(platform))

    def snapshot(self, model: Any, optimizer: Any = None, plan: Plan | None = None) -> Snapshot:
        """An nnx Module: every submodule (attributes, class) and every Variable's value; a linen
        Module is immutable (apply changes none of it, nor the params it is given)."""
        if not is_nnx(model):
            return Snapshot([model, optimizer])
        from flax import nnx

        nodes = [node for _, node in nnx.iter_graph(model)]
        modules = [n for n in nodes if isinstance(n, nnx.Module)]
        variables = [n for n in nodes if isinstance(n, nnx.Variable)]
        return Snapshot([*modules, optimizer], [(v.get_value, v.set_value) for v in variables])

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        if not self.accepts(model):
            raise TypeError(f"unimp-jax: model is {type(model)!r}; fix: pass a {self.model_types}")
        if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
            raise TypeError(
                f"unimp-jax: optimizer is {type(optimizer).__name__}; fix: pass an optax "
                f"GradientTransformation such as optax.adam(1e-3) (unimp wraps it; for inference only, "
                f"optax.identity())")
        if plan.details.slow_dtype_warning:
            warnings.warn(f"unimp: {plan.details.slow_dtype_warning}", UnimpWarning, stacklevel=3)
        if is_nnx(model):
            from .nnx_amp import NnxAmp

            _only(options, ("wrt",), "an nnx Module")
            return NnxAmp(plan, model, optimizer, **options)
        from .linen_amp import LinenAmp

        _only(options, ("params", "inputs"), "a linen Module")
        missing = [k for k in ("params", "inputs") if k not in options]
        if missing:
            raise TypeError(
                f"unimp-jax: a linen Module needs {' and '.join(missing)}; fix: unimp.apply(policy, module, "
                f"tx, params=variables['params'], inputs=x) (inputs: an example batch, for the layer map)")
        return LinenAmp(plan, model, optimizer, **options)

    def conformance_kit(self) -> Any:
        from .testing import NnxKit

        return NnxKit()


def _only(options: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise TypeError(f"unimp-jax: unknown option(s) {', '.join(extra)} for {what}; fix: use only "
                        f"{', '.join(allowed)}")
