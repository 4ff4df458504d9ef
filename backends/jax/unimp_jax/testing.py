"""Conformance kits: the shared probe as an nnx Module (:class:`NnxKit`) and a linen Module
(:class:`LinenKit`), driven through each API's idiomatic jitted training step.

>>> from unimp.conformance.probe import probe_weights
>>> NnxKit().build_probe(probe_weights()).fc1.kernel.get_value().shape
(16, 32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from unimp.conformance.kit import Kit, Observation
from unimp.conformance.probe import CLASSES, HIDDEN, KERNEL, LN_EPS, VOCAB, ProbeBatch
from unimp.spi import apply

from .op_modules import LinenOp, Op
from .optimizer import AmpOptState, find_state

# probe name -> Flax param name
FLAX_NAMES = {"embed.weight": ("embed", "embedding"), "norm.weight": ("norm", "scale")}


def flax_key(name: str) -> tuple[str, str]:
    layer, param = name.split(".")
    return FLAX_NAMES.get(name, (layer, "kernel" if param == "weight" else param))


def probe_key(layer: str, param: str) -> str:
    back = {v: k for k, v in FLAX_NAMES.items()}
    return back.get((layer, param), f"{layer}.{'weight' if param == 'kernel' else param}")


def nll(logp: Any, targets: Any) -> Any:
    return -jnp.take_along_axis(logp.astype(jnp.float32), targets[..., None], -1).mean()


def _bits(x: Any) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.uint8) if a.dtype.kind == "V" or a.dtype.name == "bfloat16" else a


class NnxProbe(nnx.Module):
    """embed -> fc1 -> relu -> conv(same, over time) -> LayerNorm -> head -> log_softmax."""

    def __init__(self, weights: dict[str, Any]) -> None:
        rngs = nnx.Rngs(0)
        channels = weights["embed.weight"].shape[1]
        self.embed = nnx.Embed(VOCAB, channels, rngs=rngs)
        self.fc1 = nnx.Linear(channels, HIDDEN, rngs=rngs)
        self.act = Op(jax.nn.relu)
        self.conv = nnx.Conv(HIDDEN, channels, kernel_size=(KERNEL,), padding="SAME", rngs=rngs)
        self.norm = nnx.LayerNorm(channels, epsilon=LN_EPS, rngs=rngs)
        self.head = nnx.Linear(channels, CLASSES, rngs=rngs)
        self.logp = Op(jax.nn.log_softmax)
        for name, value in weights.items():
            layer, param = flax_key(name)
            getattr(getattr(self, layer), param).set_value(jnp.asarray(value, jnp.float32))

    def __call__(self, tokens: Any) -> Any:
        x = self.act(self.fc1(self.embed(tokens)))
        return self.logp(self.head(self.norm(self.conv(x))))


class LinenProbeModule(nn.Module):
    channels: int = 16

    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        x = nn.Embed(VOCAB, self.channels, name="embed")(tokens)
        x = LinenOp(jax.nn.relu, name="act")(nn.Dense(HIDDEN, name="fc1")(x))
        x = nn.Conv(self.channels, (KERNEL,), padding="SAME", name="conv")(x)
        x = nn.LayerNorm(epsilon=LN_EPS, name="norm")(x)
        return LinenOp(jax.nn.log_softmax, name="logp")(nn.Dense(CLASSES, name="head")(x))


@dataclass
class LinenProbe:
    """A linen probe: the module and its params (what ``unimp.apply`` takes for linen)."""

    module: Any
    params: Any


class JaxKit(Kit):
    """What the nnx and linen kits share (every policy runs: XLA:CPU runs float16 and bfloat16, slowly)."""

    backend = "jax"

    def __init__(self) -> None:
        self._txs: dict[Any, Any] = {}
        self._steps: dict[str, Any] = {}

    def make_optimizer(self, model: Any, lr: float = 1e-2) -> Any:
        return self._txs.setdefault(lr, optax.adam(lr))  # one object: compiled steps are reused

    def make_sgd(self, model: Any, lr: float = 0.1) -> Any:
        return self._txs.setdefault(("sgd", lr), optax.sgd(lr))

    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        return self.observations(amp.report(jnp.asarray(batch.tokens)))


class NnxKit(JaxKit):
    """The probe as an nnx Module; steps through ``nnx.jit`` + ``amp.optimizer.update``."""

    def build_probe(self, weights: dict[str, Any]) -> Any:
        return NnxProbe(weights)

    def output(self, amp: Any, batch: ProbeBatch) -> Any:
        return amp.model(jnp.asarray(batch.tokens))

    def _step_fn(self, amp: Any) -> Any:
        key = amp.plan.fingerprint
        if key not in self._steps:
            def loss_fn(model: Any, tokens: Any, targets: Any, poison: Any) -> Any:
                return nll(model(tokens), targets) * jnp.where(poison, jnp.inf, 1.0)

            grad_fn = amp.value_and_grad(loss_fn)

            @nnx.jit
            def step(model: Any, optimizer: Any, tokens: Any, targets: Any, poison: Any) -> Any:
                loss, grads, _ = grad_fn(optimizer, model, tokens, targets, poison)
                optimizer.update(model, grads)
                return loss

            self._steps[key] = step
        return self._steps[key]

    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        loss = self._step_fn(amp)(amp.model, amp.optimizer, jnp.asarray(batch.tokens),
                                  jnp.asarray(batch.targets), jnp.asarray(poison))
        return float(loss)

    def snapshot(self, amp: Any) -> dict[str, Any]:
        out = {f"param/{'.'.join(map(str, k))}": _bits(v.get_value())
               for k, v in nnx.to_flat_state(nnx.state(amp.model, nnx.Param))}
        state = find_state(amp.optimizer)
        for path, leaf in jax.tree_util.tree_leaves_with_path((state.inner, state.master)):
            out[f"opt/{jax.tree_util.keystr(path)}"] = _bits(leaf)
        out["opt/step"] = np.asarray(amp.optimizer.step.get_value())
        return out

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        masters = amp.masters()
        if masters is None:
            return []
        params = dict(nnx.to_flat_state(nnx.state(amp.model, nnx.Param)))
        out = []
        for k, m in nnx.to_flat_state(masters):
            low = params[k].get_value()
            out.append((probe_key(*map(str, k)), np.asarray(low.astype(jnp.float32)),
                        np.asarray(getattr(m, "value", m))))
        return out

    def model_state(self, model: Any) -> dict[str, tuple[str, Any]]:
        return {".".join(map(str, k)): (jnp.dtype(v.get_value().dtype).name, np.asarray(v.get_value()))
                for k, v in nnx.to_flat_state(nnx.state(model))}

    def forward_fingerprint(self, model: Any, batch: ProbeBatch) -> Any:
        return np.asarray(model(jnp.asarray(batch.tokens)))

    def export_weights(self, amp: Any) -> dict[str, Any]:
        masters = amp.masters()
        source = masters if masters is not None else nnx.state(amp.model, nnx.Param)
        return {probe_key(*map(str, k)): np.asarray(getattr(v, "value", v), np.float32)
                for k, v in nnx.to_flat_state(source)}


class LinenKit(JaxKit):
    """The probe as a linen Module; steps through ``jax.jit`` over (params, opt_state)."""

    def __init__(self) -> None:
        super().__init__()
        self._probes: dict[int, LinenProbe] = {}

    def build_probe(self, weights: dict[str, Any]) -> LinenProbe:
        params: dict[str, Any] = {}
        for name, value in weights.items():
            layer, param = flax_key(name)
            params.setdefault(layer, {})[param] = jnp.asarray(value, jnp.float32)
        probe = LinenProbe(LinenProbeModule(channels=weights["embed.weight"].shape[1]), params)
        self._probes[id(probe.module)] = probe
        return probe

    def _probe(self, model: Any) -> LinenProbe:
        return model if isinstance(model, LinenProbe) else self._probes[id(model)]

    def apply(self, policy: Any, model: Any, optimizer: Any) -> Any:
        probe = self._probe(model)
        tokens = jnp.zeros((1, 1), jnp.int32)
        return apply(policy, probe.module, optimizer, backend=self.backend, params=probe.params, inputs=tokens)

    def compile(self, policy: Any, model: Any) -> Any:
        return super().compile(policy, self._probe(model).module)

    def apply_plan(self, plan: Any, model: Any, optimizer: Any) -> Any:
        probe = self._probe(model)
        return self.backend_instance().apply(plan, probe.module, optimizer, params=probe.params,
                                             inputs=jnp.zeros((1, 1), jnp.int32))

    def output(self, amp: Any, batch: ProbeBatch) -> Any:
        return amp.apply(amp.params, jnp.asarray(batch.tokens))

    def _step_fn(self, amp: Any) -> Any:
        key = amp.plan.fingerprint
        if key not in self._steps:
            def loss_fn(params: Any, tokens: Any, targets: Any, poison: Any) -> Any:
                return nll(amp.apply(params, tokens), targets) * jnp.where(poison, jnp.inf, 1.0)

            grad_fn, tx = amp.value_and_grad(loss_fn), amp.optimizer

            @jax.jit
            def step(params: Any, opt_state: Any, tokens: Any, targets: Any, poison: Any) -> Any:
                loss, grads, _ = grad_fn(opt_state, params, tokens, targets, poison)
                updates, opt_state = tx.update(grads, opt_state, params)
                return amp.apply_updates(params, updates, opt_state), opt_state, loss

            self._steps[key] = step
        return self._steps[key]

    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        amp.params, amp.opt_state, loss = self._step_fn(amp)(
            amp.params, amp.opt_state, jnp.asarray(batch.tokens), jnp.asarray(batch.targets),
            jnp.asarray(poison))
        return float(loss)

    def snapshot(self, amp: Any) -> dict[str, Any]:
        state = find_state(amp.opt_state)
        tree = {"params": amp.params, "inner": state.inner, "master": state.master}
        return {jax.tree_util.keystr(p): _bits(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}

    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        masters = amp.masters()
        if masters is None:
            return []
        return [(probe_key(layer, param), np.asarray(amp.params[layer][param].astype(jnp.float32)),
                 np.asarray(m)) for layer, ps in masters.items() for param, m in ps.items()]

    def model_state(self, model: Any) -> dict[str, tuple[str, Any]]:
        params = self._probe(model).params
        return {jax.tree_util.keystr(p): (jnp.dtype(v.dtype).name, np.asarray(v))
                for p, v in jax.tree_util.tree_leaves_with_path(params)}

    def forward_fingerprint(self, model: Any, batch: ProbeBatch) -> Any:
        probe = self._probe(model)
        return np.asarray(probe.module.apply({"params": probe.params}, jnp.asarray(batch.tokens)))

    def export_weights(self, amp: Any) -> dict[str, Any]:
        source = amp.restored_params()
        return {probe_key(layer, param): np.asarray(v, np.float32)
                for layer, ps in source.items() for param, v in ps.items()}


__all__ = ["AmpOptState", "JaxKit", "LinenKit", "LinenProbe", "NnxKit"]
