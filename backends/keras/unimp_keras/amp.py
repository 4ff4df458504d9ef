"""The Amp handle for Keras models: ``compile(optimizer=amp.optimizer)`` + ``fit``, or a custom loop
(``amp.scale_loss``, ``amp.apply_gradients``); report, state, remove.

>>> import keras, numpy as np, unimp
>>> m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, name="fc")])
>>> amp = unimp.apply("mixed_bf16", m, keras.optimizers.SGD(0.1))
>>> amp.report(np.ones((2, 8), "float32")).row("fc").compute_dtype
'bfloat16'
>>> _ = amp.remove()
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from unimp.spi import Amp, Fp8Decision, LossScale, LossScaleState, Plan, Report, ReportRow, StateError, UnsupportedError

from . import fp8, strays
from .bind import Binding, undo
from .trace import observe


class KerasAmp(Amp):
    """A unimp policy bound to one Keras model and optimizer."""

    def __init__(self, plan: Plan, model: Any, optimizer: Any, inner: Any, binding: Binding) -> None:
        super().__init__(plan, model, optimizer)
        self.inner_optimizer = inner
        self._binding = binding
        self.findings = list(binding.findings)
        self.data_formats = dict(binding.formats)  # conv/pooling data_format by layer path
        self._state = LossScale(plan.loss_scale).initial_state()  # used without an optimizer
        self._watching: Any = None  # unimp_keras.watch.KerasWatch while amp.watch() runs

    # ------------------------------------------------------------------ training verbs
    def scale_loss(self, loss: Any) -> Any:
        """``loss`` times the current loss scale (unchanged when the policy has no loss scaling)."""
        return loss if self.optimizer is None else self.optimizer.scale_loss(loss)

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
        """Unscale, check finiteness, step or skip, update the scale (``tf.function``-safe)."""
        if self.optimizer is None:
            raise ValueError("amp.apply_gradients: unimp.apply was given no optimizer; pass one: "
                             "unimp.apply(policy, model, keras.optimizers.Adam(...))")
        return self.optimizer.apply_gradients(grads_and_vars)

    # ------------------------------------------------------------------ loss-scale state
    def loss_scale_state(self) -> LossScaleState:
        return self._state if self.optimizer is None else self.optimizer.loss_scale_state()

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        if self.optimizer is None:
            self._state = state
        else:
            self.optimizer.set_loss_scale_state(state)

    # ------------------------------------------------------------------ watch
    def _start_watch(self, watch: Any) -> None:
        """``amp.watch(...)`` (the core's): numerics from Keras' compiled train_step (:mod:`unimp_keras.watch`)."""
        from .watch import start

        start(self, watch)

    def __deepcopy__(self, memo: dict[int, Any]) -> KerasAmp:
        if self._watching is not None:  # its taps are instance methods of the model: a copy would carry them
            raise UnsupportedError("copy.deepcopy(amp) while amp.watch() runs on this Keras model: stop the watch "
                                   "first (watch.close() or amp.unwatch()), copy, then watch the copy")
        return super().__deepcopy__(memo)

    # ------------------------------------------------------------------ report
    def report(self, x: Any = None) -> Report:
        """What ran in one real forward on ``x`` (default: zeros shaped like the model's inputs)."""
        if self._removed:
            raise RuntimeError("amp.report(): this Amp was removed; apply the policy again to report")
        seen, out = observe(self.model, self._binding.units, _sample(self.model) if x is None else x)
        fp8 = self.plan.fp8  # None: no layer runs FP8
        ran = {e.path: fp8.recipe for e in self._binding.fp8} if fp8 is not None else {}
        rows = [ReportRow(u.path, u.kind, *seen[u.path], fp8=ran.get(u.path)) for u in self._binding.units
                if u.path in seen]
        rows.append(ReportRow("", None, None, None, out))
        notes = [self.plan.details.loss_scaler] if self.optimizer is not None else []
        return self.report_header(rows, notes=notes + Fp8Decision.report_notes(self._binding.fp8_decisions))

    # ------------------------------------------------------------------ FP8 scaling state
    def state_dict(self) -> dict[str, Any]:
        """The canonical state, plus ``fp8``: Keras' float8 scaling weights as plain floats (when any)."""
        out = super().state_dict()
        if self._binding.fp8:
            out["fp8"] = fp8.state(self._binding.fp8)
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """As :meth:`unimp.backend.Amp.load_state_dict`; ``fp8`` (when present) checked first, then assigned exactly."""
        self._check_live("amp.load_state_dict()")
        plain = state.get("fp8") if isinstance(state, Mapping) else None
        if plain is not None:
            problems = self.fp8_state_problems(fp8.state(self._binding.fp8), plain)
            if problems:
                raise StateError("amp.load_state_dict(): " + "; ".join(problems))
        super().load_state_dict(state, strict=strict)
        if plain is not None:
            fp8.load(self._binding.fp8, plain)

    def master_pairs(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """``(path.variable, low param as float32, float32 master)`` per parameter with a master."""
        if not getattr(self.optimizer, "_masters", None):
            return []
        paths = {id(u.layer): u.path for u in self._binding.units}
        out = []
        for s in self._binding.swaps:
            if id(s.low) in self.optimizer._masters:
                name = f"{paths.get(id(s.layer), s.layer.name)}.{s.low.name}"
                out.append((name, np.asarray(s.low.numpy(), np.float32), s.original.numpy()))
        return out

    def _restore(self) -> None:
        strays.unwatch(self)
        undo(self.model, self.inner_optimizer, self.optimizer, self._binding,
             masters_on=bool(getattr(self.optimizer, "_masters", None)))


def _sample(model: Any) -> Any:
    """Zeros shaped like the model's symbolic inputs (batch 2); subclassed models need a batch."""
    inputs = getattr(model, "inputs", None) if getattr(model, "_functional", None) is None else None
    inputs = inputs or getattr(getattr(model, "_functional", None), "inputs", None)
    if not inputs:
        raise TypeError(f"amp.report(): model {model.name!r} has no symbolic inputs to make a sample from "
                        f"(subclassed model); pass a batch: amp.report(x)")
    arrays = [np.zeros([2 if d is None else d for d in t.shape], t.dtype) for t in inputs]
    return arrays[0] if len(arrays) == 1 else arrays
