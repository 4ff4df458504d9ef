"""Bind a compiled Plan to an existing Keras model (+ optimizer), each change paired with its undo: dtype
policies, low-precision parameter copies, instance methods (output cast, ...), the optimizer wrapper.

>>> import keras, unimp
>>> m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="fc")])
>>> amp = unimp.apply("mixed_bf16", m, keras.optimizers.SGD(0.1))
>>> m.get_layer("fc").dtype_policy.name
'mixed_bfloat16'
>>> _ = amp.remove(); m.get_layer("fc").dtype_policy.name
'float32'
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
from keras.src.backend import AutocastScope
from keras.src.backend.common import global_state

from unimp.spi import Plan, UnsupportedError, dtypes

from . import fp8
from .dtype_policies import FollowInputs, keras_policy
from .index import Unit, descendants, is_graph, walk
from .layout import data_formats, layout_findings
from .optimizer import AmpOptimizer, KerasAmpOptimizer, SavesAsKeras
from .params import Swap, retrack, swap_params
from .plan import keras_rule
from .trace import call_name, restore, set_method


@dataclass
class Binding:
    """What ``apply`` changed, so ``remove`` can restore it exactly."""

    units: list[Unit]
    policies: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id -> (layer, original)
    swaps: list[Swap] = field(default_factory=list)
    instance_methods: list[tuple[Any, Any, str]] = field(default_factory=list)  # (layer, own method|None, name)
    master_ids: set[int] = field(default_factory=set)  # low copies whose original is a trained master
    compiled_optimizer: Any = None
    findings: list[str] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)
    fp8: list[Any] = field(default_factory=list)  # unimp_keras.fp8.Fp8Layer per layer quantized to float8
    fp8_decisions: list[Any] = field(default_factory=list)  # unimp.plan.fp8.Fp8Decision per layer FP8 concerns


def check_inputs(model: Any, optimizer: Any) -> None:
    """Clear errors for what this backend cannot take, before anything is changed."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"unimp (keras): model must be a Keras 3 keras.Model (Sequential, functional "
                        f"or subclassed), got {type(model).__name__}; wrap a bare layer in keras.Sequential")
    if not model.built:
        raise ValueError(f"unimp (keras): model {model.name!r} is not built (its variables do not exist "
                         f"yet); call it once on a batch or model.build(input_shape) before unimp.apply, or "
                         f"build it inside unimp_keras.scope(policy)")
    if optimizer is None:
        return
    if isinstance(optimizer, list | tuple):
        raise UnsupportedError(
            f"unimp (keras): several optimizers ({len(optimizer)}) for one Keras model: apply the policy to each "
            f"sub-model with its own optimizer, e.g. amp_d = unimp.apply(policy, discriminator, d_opt); "
            f"amp_g = unimp.apply(policy, generator, g_opt), and use amp_d.optimizer / amp_g.optimizer in "
            f"train_step; each keeps its own loss scale, as Keras' mixed_float16 gives each optimizer its own "
            f"LossScaleOptimizer (keras.io DCGAN)")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError("unimp (keras): optimizer is already a LossScaleOptimizer; pass its inner "
                        "optimizer (optimizer.inner_optimizer) — unimp adds the loss scaling the policy asks for")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"unimp (keras): optimizer must be a Keras 3 keras.optimizers.Optimizer "
                        f"instance (e.g. keras.optimizers.Adam(1e-3)), got {type(optimizer).__name__}")


def _set_policy(binding: Binding, layer: Any, kp: Any) -> None:
    binding.policies.setdefault(id(layer), (layer, layer._dtype_policy))
    layer._dtype_policy = kp.for_layer(binding.policies[id(layer)][1])  # saves as the original


def _decide(plan: Plan, unit: Unit) -> tuple[str | None, str, str]:
    """(compute dtype or None to follow inputs, param dtype, category) for one unit."""
    d = plan.decide(unit.path, unit.kind, unit.type_names)
    compute = d.compute_dtype
    if d.override is None and unit.kind is not None:
        op = plan.op(unit.kind)
        if not op.honoured:
            compute = op.dtype
    elif unit.kind == "attention" and d.override is not None and d.override in plan.override_fallbacks:
        # the device cannot run it so
        compute = plan.override_fallbacks[d.override]
    return compute, d.param_dtype, d.category


def keeps_activation_dtype(plan: Plan, unit: Unit, compute: str) -> bool:
    """Whether ``unit`` is a batch_norm run in float32, returning the incoming activation's dtype (``FollowInputs``)."""
    return (unit.kind == "batch_norm" and compute == "float32"
            and plan.decide(unit.path, unit.kind, unit.type_names).override is None)


def pinned(plan: Plan, unit: Unit) -> bool:
    """Whether ``unit`` is a sublayer of a subclassed layer given a dtype of its own (keras_hub's ``Softmax(dtype=
    "float32")``: neither Keras' global policy object nor its container's), which no override names: Keras' own
    ``mixed_float16`` keeps it (a functional model's layers are not judged: a loaded file gives each its own)."""
    parent = unit.parent
    if parent is None or is_graph(parent):
        return False
    own = unit.layer._dtype_policy
    if own is parent._dtype_policy or own is keras.config.dtype_policy():
        return False
    return plan.decide(unit.path, unit.kind, unit.type_names).override is None


def apply_layers(plan: Plan, model: Any) -> Binding:
    """Findings first (they may refuse), then dtype policies and low-precision params."""
    units = walk(model)
    binding = Binding(units)
    binding.findings += plan.layout.act("keras")
    binding.formats = data_formats(units)
    binding.findings += layout_findings(binding.formats, plan.channels_last)
    plans: list[tuple[Unit, Any, str | None]] = []
    kept: set[int] = set()
    for u in units:
        if u.container:  # a composite (attention) follows its op's rule; other containers their inputs
            compute = _decide(plan, u)[0] if u.kind is not None else None
            kp = FollowInputs(u.layer.variable_dtype) if compute is None else keras_policy(compute,
                                                                                        u.layer.variable_dtype)
            plans.append((u, kp, None))
            continue
        if pinned(plan, u):  # its author's dtype and result, as Keras' own policies keep them
            kept.add(id(u.layer))
            continue
        compute, param, category = _decide(plan, u)
        if not u.has_params:
            param = "float32" if compute is None else compute
        if compute is None or keeps_activation_dtype(plan, u, compute):
            kp = FollowInputs(param, promote=category == "promote" and u.has_params)  # paramless: widest input
        else:
            kp = keras_policy(compute, param)  # may refuse before anything changed
        plans.append((u, kp, param))
    for u, kp, held in plans:
        _set_policy(binding, u.layer, kp)
        if not u.container:
            assert held is not None  # a layer's own param dtype (None only for containers)
            for sub in descendants(u.layer):  # e.g. the projections inside MultiHeadAttention
                _set_policy(binding, sub, kp if not isinstance(kp, FollowInputs) else FollowInputs(held))
        if held is not None and dtypes.is_low(held) and u.has_params:
            for layer in (u.layer, *descendants(u.layer)):
                binding.swaps += swap_params(layer, held)
    for u, decision in fp8.decide(plan, units):  # Keras' float8 Dense on the layers the Plan chose
        binding.fp8_decisions.append(decision)
        if decision.fp8:
            binding.fp8.append(fp8.quantize(plan, u, binding.policies))
            if keras.backend.backend() == "tensorflow":  # the eager-gradient limit is TensorFlow's
                set_method(u.layer, "quantized_call", fp8.guard_eager(u), binding.instance_methods)
    for u in units:
        if u.parent is not None and not is_graph(u.parent) and id(u.layer) not in kept:
            patch_stream(u.layer, u.parent, binding)
    retrack(model, [(s.original, s.low) for s in binding.swaps])
    for layer in {id(s.layer): s.layer for s in binding.swaps}.values():
        patch_save(layer, binding)
    patch_compile_config(model, binding)
    return binding


def patch_compile_config(model: Any, binding: Binding) -> None:
    """``model.save`` names Keras' own optimizer for a unimp wrapper (:class:`~unimp_keras.optimizer.SavesAsKeras`)."""
    original = model.get_compile_config

    def get_compile_config() -> Any:
        config = original()
        optimizer = getattr(model, "optimizer", None)
        if isinstance(config, dict) and isinstance(optimizer, SavesAsKeras):
            config["optimizer"] = optimizer.keras_config()
        return config

    set_method(model, "get_compile_config", get_compile_config, binding.instance_methods)


class _SaveStore:
    """The store ``save_own_variables`` writes to, with each low-precision copy saved as its original."""

    def __init__(self, store: Any, originals: dict[int, Any]) -> None:
        self._store, self._originals = store, originals

    def __setitem__(self, key: str, value: Any) -> None:
        self._store[key] = self._originals[id(value)]() if id(value) in self._originals else value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def patch_save(layer: Any, binding: Binding) -> None:
    """``model.save`` writes float32 weights for a layer holding low-precision copies: the trained master where
    the optimizer keeps one, else the low copy in the original dtype (what ``remove()`` leaves in the model)."""
    def original_value(s: Any) -> Any:
        if id(s.low) in binding.master_ids:
            return s.original
        return keras.ops.convert_to_numpy(keras.ops.cast(s.low.value, s.original.dtype))

    originals = {id(s.low): (lambda s=s: original_value(s)) for s in binding.swaps if s.layer is layer}
    save = layer.save_own_variables

    def save_own_variables(store: Any) -> None:
        save(_SaveStore(store, originals))

    set_method(layer, "save_own_variables", save_own_variables, binding.instance_methods)


# TensorFlow's tensor operators do not promote (``bfloat16 + float32`` raises); JAX's and torch's do, as Keras'
# own mixed policies rely on there
PROMOTES = keras.backend.backend() != "tensorflow"


def patch_stream(layer: Any, parent: Any, binding: Binding) -> None:
    """Hand ``layer``'s float results back in its subclassed container's dtype where the container's own ops (the
    residual ``x + attention(norm(x))``) would not get it by promotion: on TensorFlow every float result, on JAX and
    torch one promotion would not bring back (float32 in a float16 stream), as Keras' mixed policies keep it."""
    name = call_name(layer)  # a float8 layer runs quantized_call

    def call(*args: Any, **kwargs: Any) -> Any:
        out = call.inner(*args, **kwargs)  # type: ignore[attr-defined]
        stream = parent.dtype_policy.compute_dtype
        return keras.tree.map_structure(lambda t: _to_stream(t, stream), out)

    call.inner = getattr(layer, name)  # type: ignore[attr-defined]  # the report looks at the result before the cast
    set_method(layer, name, call, binding.instance_methods)


def patch_scope(model: Any, binding: Binding) -> None:
    """Run ``model``'s layers in an autocast scope where Keras would (within a ``__call__``, not JAX's
    ``stateless_call``), so a layer with ``autocast = False`` (``Embedding``) reads its variables in their own dtype."""
    original = model.call

    def call(*args: Any, **kwargs: Any) -> Any:
        if global_state.get_global_attribute("current_call_ctx") is None:
            return original(*args, **kwargs)
        with AutocastScope(None):
            return original(*args, **kwargs)

    set_method(model, "call", call, binding.instance_methods)


def patch_output(model: Any, dtype: str, binding: Binding) -> None:
    """Cast the model's float outputs to ``dtype`` (an instance-level ``call``)."""
    original = model.call

    def call(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        return keras.tree.map_structure(lambda t: _cast_float(t, dtype), out)

    set_method(model, "call", call, binding.instance_methods)


def _to_stream(t: Any, stream: str) -> Any:
    """``t`` as the stream's ops should see it: cast unless promotion against ``stream`` gives ``stream``."""
    if PROMOTES and (keras.ops.is_tensor(t) or keras.backend.is_keras_tensor(t)):
        name = keras.backend.standardize_dtype(t.dtype)
        if name != stream and dtypes.widest((name, stream)) == stream:
            return t
    return _cast_float(t, stream)


def _cast_float(t: Any, dtype: str) -> Any:
    if not (keras.ops.is_tensor(t) or keras.backend.is_keras_tensor(t)):
        return t
    name = keras.backend.standardize_dtype(t.dtype)
    return keras.ops.cast(t, dtype) if keras.backend.is_float_dtype(name) and name != dtype else t


def wrap_optimizer(plan: Plan, optimizer: Any, binding: Binding, native: bool | None) -> Any:
    """The loss-scaling (and master-weight) wrapper for ``optimizer``; ``None`` stays ``None``."""
    if optimizer is None:
        return None
    spec = plan.loss_scale  # the spec that runs: the Plan's fallbacks (on_unsupported) applied, named in its notes
    masters = {id(s.low): s.original for s in binding.swaps if s.low.trainable and plan.master_weights.enabled}
    binding.master_ids = set(masters)
    distributed = False
    if keras.backend.backend() == "tensorflow":
        from .tf_distribute import is_distributed

        distributed = is_distributed(getattr(optimizer, "_distribution_strategy", None))
    use_keras = keras_rule(spec) and not binding.swaps and not distributed if native is None else native
    if use_keras:
        if not keras_rule(spec) or binding.swaps:
            raise UnsupportedError("unimp (keras): native_loss_scale=True needs the policy's loss_scale "
                                   "to be Keras' fixed rule (dynamic, x2 / x0.5, hysteresis 1, min 0, max inf, "
                                   "growth_requires_finite false) and no low-precision params; fix: drop "
                                   "native_loss_scale or use the keras_mixed_float16 preset's loss_scale")
        if distributed:
            raise UnsupportedError("unimp (keras): native_loss_scale=True under a tf.distribute strategy: "
                                   "Keras' LossScaleOptimizer takes replica 0's finiteness (a non-finite gradient "
                                   "on another replica is applied) and reduces in the gradients' dtype, not "
                                   "distributed.reduce_dtype; fix: drop native_loss_scale (unimp's wrapper runs "
                                   "the same rule, agreed across replicas)")
        return KerasAmpOptimizer(optimizer, spec)
    return AmpOptimizer(optimizer, spec, masters=masters, reduce_dtype=plan.reduce_dtype)


def undo(model: Any, optimizer: Any, wrapper: Any, binding: Binding, masters_on: bool) -> None:
    """Restore every change ``apply`` made, in reverse order."""
    if binding.compiled_optimizer is not None:
        model.optimizer = binding.compiled_optimizer
    if wrapper is not None:
        optimizer.loss_scale_factor = wrapper._saved_factor
        if keras.backend.backend() == "tensorflow":
            from .tf_distribute import unhook_inner

            unhook_inner(optimizer)
    for layer, own, name in reversed(binding.instance_methods):
        restore(layer, own, name)
    fp8.undo(binding.fp8)
    for s in reversed(binding.swaps):
        s.undo(write_back=not (masters_on and s.low.trainable))
    retrack(model, [(s.low, s.original) for s in binding.swaps])
    for layer, original in binding.policies.values():
        layer._dtype_policy = original
    reset_compiled_functions(model)


def reset_compiled_functions(model: Any) -> None:
    """Drop traced train/test/predict functions so the next call retraces under the new dtypes."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)
