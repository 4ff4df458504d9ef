"""The request (the policy as asked) -> the Keras Plan: every op with a Keras layer class is ``layer``-controlled,
``loss`` is ``fixed`` (Keras losses compute in float32); GPUs are the Keras backend's to find, the CPU facts
``unimp.hardware``'s.

>>> import unimp
>>> plan = compile_plan(Plan.request(unimp.load("mixed_bf16"), "keras"))
>>> plan.op("linear").control, plan.op("linear").native, plan.op("loss").control
('layer', ('Dense',), 'fixed')
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from unimp.spi import LayerInfo, LossScale, LossScaleSpec, Plan, PlanRequest, UnsupportedError, dtypes, hardware, ops

from .fp8 import support as fp8_support
from .ops import NATIVE_OPS

KERAS_BACKENDS = ("tensorflow", "jax", "torch")  # the Keras backends unimp runs on


def keras_backend() -> str:
    """The Keras backend this process runs (``KERAS_BACKEND``), checked to be one unimp runs on."""
    import keras

    check_keras_backend(keras)
    return keras.backend.backend()


def check_keras_backend(keras: Any) -> None:
    """A clear :class:`UnsupportedError` for Keras 2, or a Keras 3 backend that does not train (numpy, openvino)."""
    version = getattr(keras, "__version__", "0")
    if int(version.split(".")[0]) < 3:
        raise UnsupportedError(f"unimp-keras: Keras {version} is Keras 2; unimp runs Keras 3 models; fix: "
                               f"pip install 'keras>=3' (and build the model with keras, not tf_keras)")
    name = keras.backend.backend()
    if name not in KERAS_BACKENDS:
        raise UnsupportedError(f"unimp-keras: Keras runs on its {name!r} backend, which does not train "
                               f"(no gradients); unimp runs Keras 3 on {', '.join(KERAS_BACKENDS)}; fix: set "
                               f"KERAS_BACKEND=tensorflow, jax or torch before importing keras")


def check_not_keras2(model: Any) -> None:
    """A clear :class:`UnsupportedError` for a tf_keras (Keras 2) model, which unimp-keras does not take."""
    if type(model).__module__.split(".")[0] == "tf_keras":
        raise UnsupportedError(f"unimp-keras: {type(model).__name__} is a tf_keras / Keras 2 model; unimp "
                               f"runs Keras 3 models; fix: pip install 'keras>=3', build the model with "
                               f"`import keras` (not tf_keras / TF_USE_LEGACY_KERAS=1), and pick "
                               f"KERAS_BACKEND=tensorflow, jax or torch")

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
            and spec.subnormal == keras_subnormal() and spec.scale_dtype == "float32")


def keras_subnormal() -> str:
    """What Keras' LossScaleOptimizer does with a subnormal scale here: kept on torch, flushed by TF's CPU and XLA."""
    return "keep" if _keras_backend_name() == "torch" else "flush"


def gpu_capability() -> tuple[int, int] | None:
    """The compute capability of the Keras backend's first GPU (as that backend detects it), or None."""
    name = _keras_backend_name()
    if name == "tensorflow":
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return None
        return tuple(tf.config.experimental.get_device_details(gpus[0]).get("compute_capability", (0, 0)))
    if name == "jax":
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            return None
        cc = str(getattr(gpus[0], "compute_capability", "0.0")).split(".")
        return int(cc[0]), int(cc[1]) if len(cc) > 1 else 0
    import torch

    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def _kernels() -> str:
    """Whose CPU kernels run the Keras layers, for messages."""
    return {"tensorflow": "Keras (TensorFlow, oneDNN)", "jax": "Keras (JAX, XLA:CPU)"}.get(_keras_backend_name(),
                                                                                         "Keras (torch)")


def resolve_compute_auto() -> tuple[str, str]:
    """``auto`` on this machine: bf16 on Ampere+ GPUs (fp16 + dynamic scaling before); on CPU from its facts."""
    cc = gpu_capability()
    if cc is None:
        return hardware.resolve_cpu_auto(_kernels())
    return hardware.resolve_auto(fast_bf16=cc >= (8, 0), fast_fp16=True,
                                 where=f"this GPU (compute capability {cc[0]}.{cc[1]})")


def warn_emulated(request: PlanRequest) -> str | None:
    """Warn (at the user's call) for low-precision compute a CPU-only machine emulates; the message or None."""
    slow = [(k, d) for k, d in request.compute_requests() if dtypes.is_low(d) and hardware.cpu().emulated(d)]
    if not slow or gpu_capability() is not None:
        return None
    return hardware.warn_emulated(slow[0][1], slow[0][0], _kernels())


def loss_scaler(spec: LossScaleSpec, masters: bool) -> str:
    """Which optimizer wrapper runs ``spec`` (the Plan's resolved loss scale); ``masters``: fp32 masters kept."""
    if keras_rule(spec) and not masters:
        return "loss scaling: Keras' own LossScaleOptimizer (its fixed rule is exactly the policy's)"
    return f"loss scaling: unimp LossScaleOptimizer ({spec.mode}, the core reference rule)"


def unsupported(spec: LossScaleSpec) -> dict[str, tuple[object, str]]:
    """Loss-scale knobs this Keras backend cannot honour, ``{knob: (what runs instead, why)}``: a float64 scale
    (Keras' optimizer variable is float32); on JAX what XLA cannot hold bit for bit (:func:`xla_unsupported`)."""
    if spec.mode != "dynamic":
        return {}
    out: dict[str, tuple[object, str]] = {}
    if spec.scale_dtype == "float64":
        out["scale_dtype"] = ("float32", "the Keras optimizer holds the scale in a float32 variable; fix: "
                              "scale_dtype = 'float32'")
    if _keras_backend_name() == "jax":
        out.update(xla_unsupported(spec))
    return out


def _keras_backend_name() -> str:
    import keras

    return keras.backend.backend()


def xla_flushes_subnormals() -> bool:
    """Whether XLA on the default JAX device flushes a float32 subnormal result to 0 (measured: XLA:CPU does)."""
    import jax
    import numpy as np

    with jax.ensure_compile_time_eval():
        tiny = np.float32(dtypes.FLT_TINY)
        return float(jax.jit(lambda x: x * np.float32(0.5))(tiny)) == 0.0


def xla_unsupported(spec: LossScaleSpec) -> dict[str, tuple[object, str]]:
    """The knobs Keras on JAX cannot hold: flushed subnormal scales, inexact float32 factors, a raise inside jit."""
    out: dict[str, tuple[object, str]] = {}
    flush = xla_flushes_subnormals()
    fix_x64 = "jax.config.update('jax_enable_x64', True)"
    if flush and spec.subnormal == "keep" and spec.min < dtypes.FLT_TINY:
        out["subnormal"] = ("flush", "XLA on this device flushes float32 subnormals, so a scale below 2^-126 "
                            "reads as 0; fix: subnormal = 'flush' or loss_scale.min >= 2^-126")
    if flush and spec.initial < dtypes.FLT_TINY:
        out["initial"] = (dtypes.FLT_TINY, "this XLA device reads a float32 scale below 2^-126 as 0; fix: "
                          "initial >= 2^-126")
    import jax

    if not jax.config.jax_enable_x64:
        out.update(LossScale(spec).float32_limits(flushes=flush, who="Keras on JAX (without jax_enable_x64)",
                                                  fix=fix_x64))
    if spec.at_min == "error":
        out["at_min"] = ("clamp", "Keras on JAX runs the optimizer step jitted (stateless_apply), where nothing "
                         "can raise; fix: at_min = 'clamp'")
    return out


ATTENTION_XLA_F16 = ("KERAS_BACKEND=jax: Keras' attention (keras.ops.dot_product_attention, which "
                     "MultiHeadAttention and GroupedQueryAttention call) compiles in float16 to a float16 x "
                     "float16 -> float32 dot that XLA on this device cannot run (XLA: {error}), with or without "
                     "unimp (Keras' own mixed_float16 fails the same way in fit / jit), so unimp runs the "
                     "attention layers in float32")
ATTENTION_FIX = ("on JAX's CPU move \"attention\" from [ops].lower to [ops].float32, or use bfloat16 "
                 "(mixed_bf16), a GPU, or KERAS_BACKEND=tensorflow / torch")


@functools.cache
def device_f16_attention_error() -> str | None:
    """XLA's message where Keras on JAX without a GPU cannot compile ``keras.ops.dot_product_attention`` in float16
    (measured once: XLA:CPU has no F16 x F16 -> F32 dot_general; the other Keras layers compile), else None."""
    if _keras_backend_name() != "jax" or gpu_capability() is not None:
        return None
    import jax
    import keras
    import numpy as np

    q = np.ones((1, 2, 1, 4), np.float16)  # (batch, time, heads, head dim)
    try:
        with jax.ensure_compile_time_eval():
            jax.block_until_ready(jax.jit(lambda q: keras.ops.dot_product_attention(q, q, q))(q))
    except Exception as e:  # XLA refuses at compile time (ValueError in jax 0.10)
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "not supported" not in text:
            raise
        return text
    return None


def device_fixed(request: PlanRequest, index: Iterable[LayerInfo] | None) -> dict[str, tuple[str, str]]:
    """Ops this Keras backend's device cannot run in the dtype the policy asks, ``{op: ("float32", why)}``: float16
    ``attention`` (:func:`device_f16_attention_error`), when the model has such a layer (or none is given)."""
    if request.requested("attention") != "float16":
        return {}
    if index is not None and not any(calls_dot_product_attention(info) for info in index):
        return {}
    error = device_f16_attention_error()
    return {} if error is None else {"attention": ("float32", ATTENTION_XLA_F16.format(error=error))}


# Keras' attention classes whose call runs keras.ops.dot_product_attention, and their subclasses (keras_hub's
# CachedMultiHeadAttention); keras_hub's own einsum attention (CachedGemmaAttention) compiles in float16 on XLA:CPU.
DOT_PRODUCT_ATTENTION = frozenset({"MultiHeadAttention", "GroupedQueryAttention"})


def calls_dot_product_attention(info: LayerInfo) -> bool:
    """Whether the layer is (a subclass of) one of :data:`DOT_PRODUCT_ATTENTION`."""
    return info.kind == "attention" and bool(DOT_PRODUCT_ATTENTION & set(info.type_names))


def device_override_fallbacks(request: PlanRequest,
                              index: list[LayerInfo] | None) -> tuple[list[str], dict[int, str]]:
    """Overrides asking float16 of attention layers this device cannot run so (:func:`device_fixed`'s op, per
    layer): ``(problems, {override index: "float32"})`` (without a model: every override asking float16)."""
    problems: list[str] = []
    fallbacks: dict[int, str] = {}
    error = None
    decided = [(info.path, request.decide(info.path, info.kind, info.type_names))
               for info in index or () if calls_dot_product_attention(info)]
    for r in request.override_dtypes:
        if r.key != "compute_dtype" or r.dtype != "float16":
            continue
        i = r.override
        hits = [path for path, d in decided if d.override == i and d.sets_compute]
        if index is not None and not hits:
            continue
        error = error or device_f16_attention_error()
        if error is None:
            return [], {}
        where = f"attention layers {', '.join(hits[:3])}{' ...' if len(hits) > 3 else ''}" if hits else \
            "its attention layers"
        problems.append(f"overrides[{i}].compute_dtype = 'float16' on {where}: "
                        + ATTENTION_XLA_F16.format(error=error))
        fallbacks[i] = "float32"
    return problems, fallbacks


def distributed_note(rd: str) -> str:
    """How data parallelism runs with gradients reduced in ``rd``, on this Keras backend."""
    name = _keras_backend_name()
    if name == "jax":
        return ("data parallel: Keras' own keras.distribution (DataParallel) lays out the variables and batches; "
                "the policy's layer dtypes and loss scale run as on one device, the gradients reduced as XLA "
                "shards them (in their dtype); tf.distribute is TensorFlow's")
    if name != "tensorflow":
        return f"data parallel: not run by unimp on Keras' {name} backend (tf.distribute is TensorFlow's): one device"
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
class KerasDetails:
    """What the keras backend decided at compile time (``plan.details``)."""

    loss_scaler: str  # which optimizer wrapper runs the loss scale
    distributed: str  # how tf.distribute runs under the policy


def initial_scale() -> float:
    """Where Keras' own ``LossScaleOptimizer`` starts (its ``initial_scale`` default, read from Keras: 2^15 in
    Keras 3), so where ``loss_scale.initial = "auto"`` starts on Keras.

    >>> initial_scale()
    32768.0
    """
    import inspect

    import keras

    return float(inspect.signature(keras.optimizers.LossScaleOptimizer).parameters["initial_scale"].default)


def compile_plan(request: PlanRequest, index: Iterable[LayerInfo] | None = None) -> Plan:
    """The Plan of ``request`` on Keras 3, this process' Keras backend (``index``: the model's layers, when known)."""
    keras_backend()
    request = request.starting_at(initial_scale())
    compute, reason = request.compute_dtype, "as the policy says"
    if compute == "auto":
        compute, reason = resolve_compute_auto()
        request = request.at(compute)
    elif warn_emulated(request):
        reason += f" (emulated on this CPU, slower than float32: {hardware.cpu().describe()})"
    want = request.requested("loss")
    # a loss in no op list follows its inputs: float32 only when the model's outputs are cast to float32
    # ("unchanged" outputs may be low; the Keras loss computes in float32 whatever it gets)
    follows_f32 = want is None and request.output_cast == "float32"
    fixed = {"loss": (None, LOSS_WHY + "; it takes the float32 model output, so it follows its inputs")
             if follows_f32 else ("float32", LOSS_WHY)}
    index = list(index) if index is not None else None
    device = device_fixed(request, index)
    fixed.update(device)
    problems, override_fallbacks = device_override_fallbacks(request, index)
    control = {op: "layer" for op in ops.CANONICAL_OPS if op not in fixed}
    native = {op: (*NATIVE_OPS.get(op, ()), *EXTRA_NATIVE.get(op, ())) for op in ops.CANONICAL_OPS}
    notes = list(NOTES)
    param = request.param_dtype
    if dtypes.is_low(param) or request.uses_master_weights:
        notes.append("low-precision params: Keras fixes a variable's dtype at creation, so layers holding "
                     f"{param} params get {param} copies while applied; the original float32 variables are "
                     "the masters the optimizer wrapper updates")
    spec = request.loss_scale
    knobs = unsupported(spec)  # the spec that runs, as the Plan will hold it: the wrapper is chosen for it
    details = KerasDetails(loss_scaler(LossScale(spec).as_run(knobs), request.uses_master_weights),
                           distributed_note(request.reduce_dtype))
    return request.compile(control=control, native=native, compute_reason=reason,
                           fixed=fixed, notes=(*notes, details.loss_scaler, details.distributed), details=details,
                           index=index, fp8=fp8_support(), loss_scale_unsupported=knobs,
                           problems=problems, override_fallbacks=override_fallbacks,
                           fix=ATTENTION_FIX if device or problems else "change the policy's op lists")
