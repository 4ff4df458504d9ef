"""The NumPy Amp: sets each layer's dtype rule from the Plan, scales the backward, runs the core
loss-scale rule on the host, and records the last forward for ``amp.report()``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from unimp.spi import Amp, LossScale, LossScaleState, Plan, Report, ReportRow, dtypes

from .index import model_index


class NumpyAmp(Amp):
    def __init__(self, plan: Plan, model: Any, optimizer: Any = None) -> None:
        super().__init__(plan, model, optimizer)
        self.findings += plan.layout.act(plan.backend)
        self._rule = LossScale(plan.loss_scale)
        self._state = self._rule.initial_state()
        for info, (_, layer) in zip(model_index(model), model.layers, strict=True):
            layer.rule = _rule(plan.decide(info.path, info.kind, info.type_names))
        model.output_dtype = plan.output_cast  # None: "unchanged", the last layer's dtype
        model.tracing, model.last_trace = True, None

    # the user's loop: out = amp.model(x); amp.backward(grad_of_loss_wrt_out); amp.step()

    def backward(self, grad: np.ndarray) -> None:
        """Backward of ``grad * scale`` (the loss gradient scaled by the current loss scale)."""
        self._check_live("amp.backward()")
        self.model.backward(np.asarray(grad, np.float32) * np.float32(self._state.scale))

    def step(self) -> bool:
        """Unscale, check finiteness, run the loss-scale rule; update unless it says skip. True if applied."""
        self._check_live("amp.step()")
        grads = {k: g / np.float32(self._state.scale) for k, g in self.model.named_grads().items()}
        finite = all(bool(np.isfinite(g).all()) for g in grads.values())
        outcome = self._rule.update(self._state, finite)
        self._state = outcome.state
        if not outcome.skipped and self.optimizer is not None:
            self.optimizer.step(grads)
        return not outcome.skipped

    def loss_scale_state(self) -> LossScaleState:
        return self._state

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        self._state = state

    def report(self, *inputs: Any) -> Report:
        if inputs:
            self.model(*inputs)
        elif self.model.last_trace is None:
            raise self.no_forward()
        rows = [ReportRow(path, self.plan.layer(path).kind, dt, param, out)
                for path, dt, param, out in self.model.last_trace]
        return self.report_header(rows)

    def _restore(self) -> None:
        for _, layer in self.model.layers:
            layer.rule = None
        self.model.output_dtype = None
        self.model.tracing, self.model.last_trace = False, None


def _rule(decision: Any) -> Any:
    """The layer's dtype given its input's and its params' (as the core's decision says)."""
    def rule(x: str | None, param: str | None) -> str | None:
        if decision.compute_dtype is not None:
            return decision.compute_dtype
        if decision.category == "promote" and decision.override is None:
            return dtypes.widest([x, param])
        return None
    return rule
