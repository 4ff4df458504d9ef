"""The JAX backend class (entry point ``unimp.backends: jax``); imports no framework at import.

>>> from unimp_jax.backend import JaxBackend
>>> JaxBackend.name, JaxBackend.framework
('jax', 'flax')
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar

from unimp.spi import Amp, Backend, Plan, PlanRequest, Snapshot, UnimpWarning, UnsupportedError, load, ops

from .layers import is_linen, is_nnx
from .ops import NATIVE_OPS
from .plan import compile_plan


class JaxBackend(Backend):
    """Flax nnx and linen Modules with optax optimizers."""

    name = "jax"
    framework = "flax"
    distribution = "unimp-jax"
    model_types = "flax.nnx.Module or flax.linen.Module (with an optax GradientTransformation)"
    native_ops: ClassVar = ops.native_table("jax", NATIVE_OPS)
    tags: ClassVar = frozenset({"fp16", "bf16", "master_weights", "loss_scaling", "training", "overrides", "layout",
                                "layer_level", "distributed", "remove"})

    def accepts(self, model: Any) -> bool:
        return is_nnx(model) or is_linen(model)

    def plan(self, request: PlanRequest, model: Any = None) -> Plan:
        return compile_plan(request, model)

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
        if isinstance(optimizer, list | tuple) and not hasattr(optimizer, "update"):  # optax txs are NamedTuples
            raise UnsupportedError(
                f"unimp-jax: {len(optimizer)} optax transformations for one model: optax cannot tell which "
                f"parameters each steps; fix: combine them into one, labelled by parameter, "
                f"optax.multi_transform({{'body': tx_a, 'head': tx_b}}, labels) (one loss scale and one finiteness "
                f"check for both, as jmp's DynamicLossScale around it); separate models (a GAN's generator and "
                f"discriminator) get one Amp each: unimp.apply(policy, generator, g_tx) and unimp.apply(policy, "
                f"discriminator, d_tx)")
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


def wrap(tx: Any, policy: Any) -> Any:
    """The optax transformation ``tx`` under the loss scaling and master weights of ``policy`` (anything
    :func:`unimp.load` takes) as this backend compiles it (:func:`unimp_jax.optimizer.amp_tx`)."""
    from .optimizer import amp_tx

    plan = JaxBackend().compile(load(policy))
    return amp_tx(tx, plan.loss_scale, plan.uses_master_weights)


def _only(options: dict[str, Any], allowed: tuple[str, ...], what: str) -> None:
    extra = sorted(set(options) - set(allowed))
    if extra:
        raise TypeError(f"unimp-jax: unknown option(s) {', '.join(extra)} for {what}; fix: use only "
                        f"{', '.join(allowed)}")
