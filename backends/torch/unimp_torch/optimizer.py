"""The optimizer wrapper: unscale, finiteness check, skip or step, scale update, master weights.

``amp.optimizer`` is a ``torch.optim.Optimizer`` (LR schedulers accept it) that delegates to the
user's optimizer. A skipped step changes no parameter, master or optimizer state:

- fused optimizers (``fused=True``; torch marks them ``_step_supports_amp_scaling``) get the
  device-side ``found_inf`` flag and skip inside their kernel (no host sync; step counts restored).
  A step that would create optimizer state (the first one) reads the flag on the host, and a
  skip deletes the state the kernel allocated but never filled: "no state yet" stays so;
- any other optimizer is simply not called when the flag is set (one host read of the flag:
  free on CPU, one sync on CUDA, as ``torch.amp.GradScaler`` does for non-fused optimizers).

Sparse gradients (``nn.Embedding(sparse=True)``) are unscaled and checked on their values, as
``torch.amp.GradScaler`` does (float16 ones coalesced first). Unscaling happens once per set of
gradients: it is remembered until a new loss is scaled, so an exception inside ``step()`` (a
caught Ctrl-C) neither leaves this step's flag behind for the next one nor unscales twice when
the step is retried.

>>> import torch, unimp
>>> m = torch.nn.Linear(2, 2)
>>> amp = unimp.apply("mixed_fp16", m, torch.optim.SGD(m.parameters(), lr=0.1))
>>> amp.backward(m(torch.randn(3, 2)).sum() * float("inf")); amp.optimizer.step(); amp.skipped_steps
1
>>> _ = amp.remove()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unimp.spi import UnsupportedError

from .params import ParamState
from .scaler import DeviceLossScale
from .validate import check_optimizer_state


class AmpOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; construct through :func:`unimp.apply`.

    ``live(verb)`` raises once the Amp is removed; ``names`` maps ``id(param)`` of the
    optimizer's parameters to their model names (for messages).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: DeviceLossScale, params: ParamState,
                 on_skip: Callable[[], Any] | None = None, live: Callable[[str], None] | None = None,
                 names: dict[int, str] | None = None) -> None:
        # deliberately not calling Optimizer.__init__: state and groups are the inner optimizer's
        self.optimizer = optimizer
        self.scaler = scaler
        self.params = params
        self.on_skip = on_skip
        self.live = live
        self.names = names or {}
        # (found_inf, scaler.losses) once this step's grads are unscaled: valid until a new loss is scaled
        self._unscaled: tuple[torch.Tensor, int] | None = None
        self.last_skipped: torch.Tensor | None = None  # device bool of the last step (no sync)
        self._fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        # set by unimp_torch.distributed: all-reduce found_inf (MAX) so every rank skips alike
        self.agree: Callable[[torch.Tensor], None] | None = None
        self._checked_dist = False
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    # delegate what LR schedulers and users read
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property
    def found_inf(self) -> torch.Tensor | None:
        """This step's non-finite flag (device float32 0/1) once its grads are unscaled, else None."""
        return self._unscaled[0] if self._current() else None

    def _live(self, verb: str) -> None:
        if self.live is not None:
            self.live(verb)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` (its params are the fp32 masters where there are
        masters; their values are in ``model.state_dict()``)."""
        self._live("amp.optimizer.state_dict()")
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state after checking all of it: a wrong dict raises
        :class:`unimp.errors.StateError` naming the key, and nothing is loaded."""
        self._live("amp.optimizer.load_state_dict()")
        check_optimizer_state(self.optimizer, state_dict, self.names)
        self.optimizer.load_state_dict(state_dict)
        self._unscaled = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UnsupportedError("amp.optimizer.add_param_group: add the group to the optimizer before "
                               "unimp.apply (amp.remove(), add it, apply again)")

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.optimizer!r})"

    # torch.optim.Optimizer pickles only defaults/state/param_groups; this wrapper is its attributes
    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # ------------------------------------------------------------------ the step
    def master_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _current(self) -> bool:
        """Whether the grads were unscaled since the last scaled loss."""
        return self._unscaled is not None and self._unscaled[1] == self.scaler.losses

    def unscale_(self) -> torch.Tensor | None:
        """Move grads to the masters and divide by the scale (once per set of grads); returns found_inf."""
        self._live("amp.optimizer.unscale_()")
        if not self.scaler.checks:
            return None
        if self._current():
            return self._unscaled[0]
        for _, low, master in self.params.masters:
            master.grad = None if low.grad is None else low.grad.to(master.dtype)
        grads = []
        for p in self.master_params():
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                if p.grad.dtype == torch.float16:  # duplicates summed before the check, as GradScaler
                    p.grad = p.grad.coalesce()
                grads.append(p.grad._values())
            else:  # FSDP2 grads are DTensors: check and unscale each rank's local shard in place
                grads.append(getattr(p.grad, "_local_tensor", p.grad))
        found = self.scaler.unscale_(grads)
        if self.agree is not None:
            self.agree(found)  # on the device, no host read
        self._unscaled = (found, self.scaler.losses)
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._live("amp.optimizer.zero_grad()")
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, low, _ in self.params.masters:
            if set_to_none:
                low.grad = None
            elif low.grad is not None:
                low.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._live("amp.optimizer.step()")
        if closure is not None:
            raise UnsupportedError("amp.optimizer.step(closure): closures re-run forward and backward "
                                   "inside step, which loss scaling cannot see; call amp.backward(loss) "
                                   "then amp.optimizer.step()")
        if not self._checked_dist:
            self._checked_dist = True
            if self.agree is None:
                from .distributed import warn_undistributed

                warn_undistributed()
        if not self.scaler.checks:  # no scaling, no skipping: the plain step
            if self.params.masters:
                for _, low, master in self.params.masters:
                    master.grad = None if low.grad is None else low.grad.to(master.dtype)
            out = self.optimizer.step()
            self.params.sync_low()
            self.scaler.update(None)
            return out
        found = self.unscale_()
        out = None
        skip = self.scaler.spec.skip_nonfinite
        if skip and self._fused:
            out, skipped_now = self._fused_step(found)
        elif skip:
            skipped_now = bool(found.item())
            if not skipped_now:
                out = self.optimizer.step()
                self.params.sync_low()
        else:
            out = self.optimizer.step()
            self.params.sync_low()
            skipped_now = False
        # reached only when the step returned: an exception leaves the scale and counters as they were
        self.last_skipped = found > 0 if skip else torch.zeros((), dtype=torch.bool)
        self.scaler.update(found)
        self._unscaled = None
        if skipped_now and self.on_skip is not None:
            self.on_skip()
        return out

    def _fused_step(self, found: torch.Tensor) -> tuple[Any, bool | None]:
        """The kernel skips on ``found``; state it allocated for a skipped first step is dropped."""
        state, params = self.optimizer.state, self.master_params()
        # params without state yet (none once every param has some: no per-param loop then)
        fresh = [p for p in params if p.grad is not None and not state.get(p)] if len(state) < len(params) else []
        self.optimizer.grad_scale, self.optimizer.found_inf = None, found
        try:
            out = self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf
        created = [p for p in fresh if state.get(p)]
        skipped_now = bool(found.item()) if created or self.on_skip else None  # host read: first step only
        if created and skipped_now:
            for p in created:
                del state[p]
        self.params.sync_low()
        return out, skipped_now
