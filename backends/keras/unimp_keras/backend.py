"""The unimp plug-in for Keras 3 models on TensorFlow, JAX or torch (entry point ``unimp.backends: keras``); this
module imports no framework (unimp looks at it once ``keras`` is imported).

>>> import unimp
>>> KerasBackend().compile(unimp.load("mixed_bf16")).op("conv").dtype
'bfloat16'
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, ClassVar

from unimp.spi import Amp, Backend, Plan, PlanRequest, Snapshot, ops

from .ops import NATIVE_OPS
from .plan import KERAS_BACKENDS, check_keras_backend, check_not_keras2, compile_plan, initial_scale, keras_backend

OPTIONS = ("native_loss_scale",)


class KerasBackend(Backend):
    """Keras 3 models and optimizers, on the TensorFlow, JAX or torch backend of Keras (``KERAS_BACKEND``)."""

    name: ClassVar[str] = "keras"
    framework: ClassVar[str] = "keras"
    distribution: ClassVar[str] = "unimp-keras"
    model_types: ClassVar[str] = f"keras.Model (Keras 3; KERAS_BACKEND {' | '.join(KERAS_BACKENDS)})"
    native_ops: ClassVar = ops.native_table("keras", NATIVE_OPS)
    tags: ClassVar = frozenset({"fp16", "bf16", "master_weights", "loss_scaling", "training", "overrides", "layout",
                                "layer_level", "distributed", "remove"})
    # above unimp-torch and unimp-ipex: on KERAS_BACKEND=torch a Keras model is also a torch.nn.Module
    priority: ClassVar[int] = 20

    def accepts(self, model: Any) -> bool:
        """Any Keras 3 ``keras.Model``; one unimp cannot run (another Keras backend, tf_keras) is a clear error."""
        keras = sys.modules.get("keras")
        if keras is not None and isinstance(model, getattr(keras, "Model", ())):
            check_keras_backend(keras)
            return True
        check_not_keras2(model)
        return False

    def initial_scale(self) -> float:
        """Keras' ``LossScaleOptimizer`` default (2^15), read from Keras."""
        return initial_scale()

    def plan(self, request: PlanRequest, model: Any = None) -> Plan:
        from .index import model_index

        return compile_plan(request, model_index(model) if model is not None else None)

    def snapshot(self, model: Any, optimizer: Any = None, plan: Plan | None = None) -> Snapshot:
        """Every layer (attributes, dtype policy, instance methods, tracker) and the optimizer (variables: by id)."""
        import keras

        layers = [model, *model._flatten_layers(include_self=False, recursive=True)] \
            if isinstance(model, keras.layers.Layer) else [model]
        trackers = [t for layer in layers if (t := layer.__dict__.get("_tracker")) is not None]
        return Snapshot([*layers, *trackers, optimizer])

    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        """Set per-layer dtype policies on ``model`` and wrap ``optimizer`` for loss scaling. ``native_loss_scale``:
        ``None`` uses Keras' own LossScaleOptimizer exactly when the policy's rule is Keras', ``False`` never,
        ``True`` always."""
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unimp.apply (keras): unknown option(s) {unknown}; valid: {list(OPTIONS)}")
        from . import bind, strays
        from .amp import KerasAmp
        from .index import model_index

        bind.check_inputs(model, optimizer)
        if not plan.layers:  # compiled without the model: index it once
            plan = plan.with_index(model_index(model))
        strategy = None
        if keras_backend() == "tensorflow":
            from .tf_distribute import strategy_of

            strategy = strategy_of(model, optimizer)  # tf.distribute: variables unimp creates are mirrored
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            binding = bind.apply_layers(plan, model)
            wrapper = None
            try:
                wrapper = bind.wrap_optimizer(plan, optimizer, binding, options.get("native_loss_scale"))
                if wrapper is not None and strategy is not None:
                    wrapper.build(model.trainable_variables)  # mirrored state before strategy.run
            except Exception:
                bind.undo(model, optimizer, wrapper, binding, masters_on=False)
                raise
        bind.patch_scope(model, binding)  # layers that do not autocast read their variables as under Keras' policy
        if plan.output_cast is not None:  # "unchanged": the last layer's compute dtype, as Keras gives it
            bind.patch_output(model, plan.output_cast, binding)
        if wrapper is not None and getattr(model, "optimizer", None) is optimizer:
            binding.compiled_optimizer = optimizer
            model.optimizer = wrapper
        bind.reset_compiled_functions(model)
        amp = KerasAmp(plan, model, wrapper, optimizer, binding)
        strays.watch(amp)  # optimizers stepping this model around unimp are refused (unimp_keras.strays)
        return amp

    def scope(self, plan: Plan) -> Any:
        """``unimp.scope(policy)``: build new Keras models under the compiled ``plan`` (see :mod:`.building`)."""
        from .building import scope

        return scope(plan, self)

    def conformance_kit(self) -> Any:
        from .testing import KerasKit

        return KerasKit()
