"""Compile a policy for Keras: per canonical op the layer classes that carry it. No TF import.

Keras decides dtypes per layer, so every op with a Keras layer class is ``layer``-controlled;
``loss`` is ``fixed`` (Keras losses compute in float32). ``auto`` (and a low-precision dtype on a
CPU without native units) imports TensorFlow to look for GPUs; the CPU facts are ``unimp.hardware``'s.

>>> import unimp
>>> plan = compile_plan(unimp.load("mixed_bf16"))
>>> plan.op("linear").control, plan.op("linear").native, plan.op("loss").control
('layer', ('Dense',), 'fixed')
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from unimp.spi import (
    CANONICAL_OPS,
    LayerInfo,
    LossScaleSpec,
    Plan,
    Policy,
    compile_ops,
    cpu,
    is_low,
    loss_scale_fallbacks,
    requested_dtype,
    resolve_auto,
    resolve_cpu_auto,
    resolved_loss_scale,
)
from unimp.spi import (
    warn_emulated as warn_cpu_emulated,
)

from .fp8 import support as fp8_support
from .ops import NATIVE_OPS

BACKEND = "tensorflow"
EXTRA_NATIVE = {
    "softmax": ("Activation(softmax)",),
    "log_softmax": ("Activation(log_softmax)",),
    "transcendental": ("(any layer: runs in that layer's dtype)",),
    "reduction": ("(any layer: runs in that layer's dtype)",),
}
LOSS_WHY = "Keras losses compute in float32 (keras.losses.Loss dtype = floatx)"
NOTES = (
    "Keras sets dtypes per layer: an op inside a layer (exp, sum, ...) runs in that layer's compute "
    "dtype; transcendental/reduction are honoured where they are layers of their own (give a custom "
    "layer class an override `types = [\"MyLayer\"]`).",
    "Keras' normalisation layers compute their statistics in at least float32 whatever the layer's "
    "dtype; their output dtype follows the policy.",
    "A layer in no op list follows its input's dtype, resolved per call (unimp's FollowInputs policy).",
)


def keras_rule(spec: LossScaleSpec) -> bool:
    """Whether ``spec`` is exactly Keras 3's fixed LossScaleOptimizer rule."""
    return (spec.mode == "dynamic" and spec.growth_factor == 2.0 and spec.backoff_factor == 0.5
            and spec.hysteresis == 1 and spec.min == 0.0 and spec.max == float("inf")
            and spec.skip_nonfinite and spec.growth_schedule == "interval"
            and not spec.growth_requires_finite and spec.at_min == "clamp"
            and spec.subnormal == "flush" and spec.scale_dtype == "float32")  # it flushes on TF's CPU kernels


def _gpus() -> list:
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def resolve_compute_auto() -> tuple[str, str]:
    """``auto`` on this machine: bf16 on Ampere+ GPUs (fp16 + dynamic scaling before); on CPU from its facts."""
    import tensorflow as tf

    gpus = _gpus()
    if not gpus:
        return resolve_cpu_auto("Keras (oneDNN)")
    cc = tuple(tf.config.experimental.get_device_details(gpus[0]).get("compute_capability", (0, 0)))
    return resolve_auto(fast_bf16=cc >= (8, 0), fast_fp16=True,
                        where=f"this GPU (compute capability {cc[0]}.{cc[1]})")


def warn_emulated(policy: Policy, compute: str) -> str | None:
    """Warn (at the user's call) for low-precision compute a CPU-only machine emulates; the message or None."""
    wanted = [("compute_dtype", compute)] + [(f"overrides[{i}].compute_dtype", o.compute_dtype)
                                             for i, o in enumerate(policy.overrides)]
    slow = [(k, d) for k, d in wanted if is_low(d) and cpu().emulated(d)]
    if not slow or _gpus():
        return None
    return warn_cpu_emulated(slow[0][1], slow[0][0], "Keras (oneDNN)")


def loss_scaler(policy: Policy, spec: LossScaleSpec) -> str:
    """Which optimizer wrapper runs ``spec`` (the Plan's resolved loss scale) for ``policy``."""
    if keras_rule(spec) and not policy.uses_master_weights:
        return "loss scaling: Keras' own LossScaleOptimizer (its fixed rule is exactly the policy's)"
    return f"loss scaling: unimp LossScaleOptimizer ({spec.mode}, the core reference rule)"


def scale_fallbacks(policy: Policy) -> list[str]:
    """Loss-scale knobs this backend cannot honour: an UnsupportedError, or Plan notes (fallback)."""
    from .scaler import unsupported

    return loss_scale_fallbacks(policy.loss_scale, unsupported(policy.loss_scale),
                                f"policy {policy.name!r} ({policy.source})", policy.on_unsupported)


def distributed_note(policy: Policy) -> str:
    """How tf.distribute runs under the policy (the Keras 3 facts this backend works around)."""
    rd = policy.distributed.reduce_dtype
    how = ("in float32" if rd == "float32" else
           f"in {rd}: each replica casts its scaled gradients to {rd} before the sum, back after")
    return (f"tf.distribute (MirroredStrategy): unimp's optimizer wrapper all-reduces gradients (SUM) {how} "
            "(Keras has no reduce-dtype hook: its optimizer sums in the gradients' dtype; the wrapped "
            "optimizer's own sum is bypassed); finiteness is checked on the reduced gradients and agreed "
            "across replicas, so all replicas skip together; loss-scale state is mirrored and updated once. "
            "Keras' LossScaleOptimizer is not used under a strategy (it takes replica 0's finiteness). "
            "Gradient clipping of the inner optimizer sees the reduced gradients. jit_compile=True is refused "
            "(keras#21366)")


@dataclass(frozen=True)
class TensorFlowDetails:
    """What the tensorflow backend decided at compile time (``plan.details``)."""

    loss_scaler: str  # which optimizer wrapper runs the loss scale
    distributed: str  # how tf.distribute runs under the policy


def compile_plan(policy: Policy, index: Iterable[LayerInfo] | None = None) -> Plan:
    """The Plan for ``policy`` on Keras 3 / TensorFlow (``index``: the model's layers, when known)."""
    compute, reason = policy.compute_dtype, "as the policy says"
    if compute == "auto":
        compute, reason = resolve_compute_auto()
    elif warn_emulated(policy, compute):
        reason += f" (emulated on this CPU, slower than float32: {cpu().describe()})"
    want = requested_dtype(policy, "loss", compute)
    # a loss in no op list follows its inputs: float32 only when the model's outputs are cast to float32
    # ("unchanged" outputs may be low; the Keras loss computes in float32 whatever it gets)
    follows_f32 = want is None and policy.output_cast == "float32"
    fixed = {"loss": (None, LOSS_WHY + "; it takes the float32 model output, so it follows its inputs")
             if follows_f32 else ("float32", LOSS_WHY)}
    control = {op: "layer" for op in CANONICAL_OPS if op not in fixed}
    native = {op: (*NATIVE_OPS.get(op, ()), *EXTRA_NATIVE.get(op, ())) for op in CANONICAL_OPS}
    notes = list(NOTES)
    if is_low(policy.param_dtype) or policy.uses_master_weights:
        notes.append("low-precision params: Keras fixes a variable's dtype at creation, so layers holding "
                     f"{policy.param_dtype} params get {policy.param_dtype} copies while applied; the "
                     "original float32 variables are the masters the optimizer wrapper updates")
    details = TensorFlowDetails(loss_scaler(policy, resolved_loss_scale(policy, compute)), distributed_note(policy))
    notes.append(details.loss_scaler)
    notes.extend(scale_fallbacks(policy))
    notes.append(details.distributed)
    return compile_ops(BACKEND, policy, control=control, native=native, compute_dtype=compute,
                       compute_reason=reason, fixed=fixed, notes=tuple(notes), details=details, index=index,
                       fp8=fp8_support())
