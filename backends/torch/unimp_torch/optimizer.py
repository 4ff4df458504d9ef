"""The optimizer wrapper: unscale, finiteness check, skip or step, scale update, master weights.

``amp.optimizer`` is a ``torch.optim.Optimizer`` delegating to the user's. A skipped step changes no parameter,
master or optimizer state: fused optimizers (``_step_supports_amp_scaling``) get the device-side ``found_inf``
and skip in their kernel (a first step's fresh state is deleted on skip); any other is not called when the flag
is set (one host read, as ``torch.amp.GradScaler``). Sparse gradients are unscaled and checked on their values.
Unscaling happens once per set of gradients (remembered until a new loss is scaled), so a step retried after an
exception neither keeps a stale flag nor unscales twice.

>>> import torch, unimp
>>> m = torch.nn.Linear(2, 2)
>>> amp = unimp.apply("mixed_fp16", m, torch.optim.SGD(m.parameters(), lr=0.1))
>>> amp.backward(m(torch.randn(3, 2)).sum() * float("inf")); amp.optimizer.step(); amp.skipped_steps
1
>>> _ = amp.remove()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from unimp.spi import UnsupportedError

from .iteration import Iteration
from .params import MasterGrad, ParamState
from .scaler import DeviceLossScale
from .validate import check_optimizer_state


def _inner(name: str) -> Any:
    """An attribute of the wrapped optimizer, read and set through the wrapper."""
    return property(lambda self: getattr(self.optimizer, name), lambda self, v: setattr(self.optimizer, name, v))


class AmpOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; construct through :func:`unimp.apply`.

    ``live(verb)`` raises once the Amp is removed; ``names``: ``id(param)`` -> model name (for messages);
    ``iteration``: the optimizers sharing the loss scale (:mod:`unimp_torch.iteration`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: DeviceLossScale, params: ParamState,
                 on_skip: Callable[[], Any] | None = None, live: Callable[[str], None] | None = None,
                 names: dict[int, str] | None = None, iteration: Iteration | None = None) -> None:
        # deliberately not calling Optimizer.__init__: state and groups are the inner optimizer's
        self.optimizer = optimizer
        self.scaler = scaler
        self.params = params
        own = {id(p) for g in optimizer.param_groups for p in g["params"]}
        self.masters = [t for t in params.masters if id(t[2]) in own]  # (name, low, master) of this optimizer's params
        self.iteration = iteration if iteration is not None else Iteration(scaler)
        self.iteration.join(self, type(optimizer).__name__)
        self.in_step = False  # the inner optimizer's step is being called from step() (the step pre-hook reads it)
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
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = {}
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = {}
        # (found_inf, skip, fresh params) of the step in flight until _finish has run
        self._pending: tuple[torch.Tensor | None, bool, Sequence[torch.Tensor]] | None = None
        self._stepped = False  # the inner step of the step in progress ran (its post-hook was called)
        self._skipped_now: bool | None = None
        self._losses_spent = 0  # scaler.losses when the last step was done: equal = no loss scaled since

    # what LR schedulers and users read and set: the inner optimizer's
    param_groups = _inner("param_groups")
    state = _inner("state")
    defaults = _inner("defaults")

    @property
    def found_inf(self) -> torch.Tensor | None:
        """This step's non-finite flag (device float32 0/1) once its grads are unscaled, else None."""
        return self._unscaled[0] if self._unscaled is not None and self._current() else None

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

    def master_params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _current(self) -> bool:
        """Whether the grads were unscaled since the last scaled loss."""
        return self._unscaled is not None and self._unscaled[1] == self.scaler.losses

    def unscale_(self) -> torch.Tensor | None:
        """Move this optimizer's grads to its masters and divide by the scale (once per set of grads); returns
        found_inf (of this optimizer's parameters only)."""
        self._live("amp.optimizer.unscale_()")
        if not self.scaler.checks:
            return None
        if self._unscaled is not None and self._current():
            return self._unscaled[0]
        if self.scaler.spec.mode != "none" and self.scaler.losses == self._losses_spent:
            self._refuse_unscaled_backward()
        for _, low, master in self.masters:
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
        # the low-precision params show the masters' unscaled grads: clip_grad_norm_(model.parameters()) clips them
        for _, low, master in self.masters:
            if low.grad is not None and master.grad is not None and not master.grad.is_sparse:
                low.grad = MasterGrad(master.grad, low.dtype)
        return found

    def _refuse_unscaled_backward(self) -> None:
        """No loss was scaled since the last step: gradients from a plain ``loss.backward()`` would be
        divided by the loss scale. Refused (nothing changed) when there are gradients at all."""
        grads = [n for p in self.master_params() if p.grad is not None for n in (self.names.get(id(p), "?"),)]
        grads += [name for name, low, _ in self.masters if low.grad is not None]
        if not grads:
            return
        raise UnsupportedError(
            f"amp.optimizer.step(): no loss was scaled since the last step, but parameters have gradients "
            f"(e.g. {grads[0]}): they come from a plain loss.backward(), and stepping would divide them by "
            f"the loss scale ({self.scaler.scale.item():g}). Call amp.backward(loss) (or "
            f"amp.scale_loss(loss).backward()) instead of loss.backward(); with a Trainer, use unimp's "
            f"integration (unimp_torch.integrations.hf / .lightning)")

    def refuse_after_unscale(self, verb: str) -> None:
        """A new scaled loss after :meth:`unscale_` and before the step is refused (nothing changed): its
        gradients would add scaled values to the unscaled ones and the step would be wrong without a word."""
        if not self._current():
            return
        raise UnsupportedError(
            f"{verb}: amp.optimizer.unscale_() already unscaled this step's gradients, and a new scaled loss "
            f"would add scaled gradients to them; with gradient accumulation call amp.optimizer.unscale_() "
            f"(and clip) once, after the last micro-batch's amp.backward(loss), then amp.optimizer.step() "
            f"(or amp.optimizer.zero_grad() to drop these gradients)")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._live("amp.optimizer.zero_grad()")
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._unscaled = None  # these gradients are gone: a new loss starts a new set
        for _, low, _ in self.masters:
            if set_to_none:
                low.grad = None
            elif isinstance(low.grad, MasterGrad):  # the next backward accumulates in low precision again
                low.grad = torch.zeros_like(low)
            elif low.grad is not None:
                low.grad.zero_()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Unscale, check, skip or step; low params := masters and the scale updated by the inner optimizer's
        first step post-hook, before any user hook (an exception there cannot leave weights behind the masters)."""
        self._live("amp.optimizer.step()")
        self.iteration.check_step(self, "amp.optimizer.step()")
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
            for _, low, master in self.masters:
                master.grad = None if low.grad is None else low.grad.to(master.dtype)
            out = self._inner_step(None, False, ())
            self.iteration.notify()
            return out
        found = self.unscale_()
        assert found is not None  # scaler.checks: unscale_() returns found_inf
        skip = self.scaler.spec.skip_nonfinite
        if skip and self._fused:
            state, params = self.optimizer.state, self.master_params()
            # params without state yet (none once every param has some: no per-param loop then)
            fresh = [p for p in params if p.grad is not None and not state.get(p)] if len(state) < len(params) else []
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found  # the kernel skips on found
            try:
                out = self._inner_step(found, skip, fresh)
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            skipped_now = self._skipped_now
        elif skip and bool(found.item()):  # skipped: the inner optimizer is not called
            self._count(found, skip)
            out, skipped_now = None, True
        else:
            out, skipped_now = self._inner_step(found, skip, ()), False
        if skipped_now and self.on_skip is not None:
            self.on_skip()
        self.iteration.notify()  # the iteration's end, when this step made the scale's update (amp.watch())
        return out

    def _inner_step(self, found: torch.Tensor | None, skip: bool, fresh: Sequence[torch.Tensor]) -> Any:
        """The inner optimizer's step; :meth:`_finish` runs from its post-hook (or right after, when the
        hook is gone). An exception before the inner step completes leaves the scale and counters as they were."""
        # bumped by the inner step's in-place update (a fused kernel bumps only its state's step counter)
        state = self.optimizer.state
        params = [t for p in self.master_params() if p.grad is not None
                  for t in (p, state.get(p, {}).get("step")) if isinstance(t, torch.Tensor)]
        versions, held = [p._version for p in params], len(state)  # a first step adds state
        self._pending, self._stepped = (found, skip, fresh), False
        try:
            self.in_step = True
            try:
                out = self.optimizer.step()
            finally:
                self.in_step = False
            self._finish()
        except BaseException:
            # a Ctrl-C after the inner step updated the params: the model gets the masters' values, the step counts
            if self._pending is not None and (self._stepped or len(state) != held or any(
                    p._version != v for p, v in zip(params, versions, strict=True))):
                self._finish()
            self._pending = None
            raise
        return out

    def _finish(self) -> None:
        """After the inner step (or the decision to skip it): state a skipped fused first step
        allocated is dropped, low params := masters, the scale and counters updated. Runs once."""
        if self._pending is None:
            return
        found, skip, fresh = self._pending
        self._stepped = True  # kept pending until the model has the masters' values (run again if interrupted)
        self._skipped_now = None
        if fresh:  # fused: state the kernel allocated but never filled on a skipped first step
            state = self.optimizer.state
            created = [p for p in fresh if state.get(p)]
            assert found is not None  # fresh: a fused step under a scaler that checks
            self._skipped_now = bool(found.item()) if created or self.on_skip else None  # host read: first step
            if created and self._skipped_now:
                for p in created:
                    del state[p]
        elif self._fused and skip and self.on_skip is not None:
            assert found is not None  # skip: a scaler that checks
            self._skipped_now = bool(found.item())
        self.params.sync_low(self.masters)
        self._count(found, skip)
        self._pending = None

    def _count(self, found: torch.Tensor | None, skip: bool) -> None:
        """The step is done (or skipped): the scale and counters updated, this step's grads spent."""
        if found is None:  # no scaling, no skipping
            self.iteration.stepped(self, None)
            return
        self.last_skipped = found > 0 if skip else torch.zeros((), dtype=torch.bool)
        self.iteration.stepped(self, found)
        self._pending = None  # counted: an interrupt from here on does not count it again
        self._unscaled = None
        self._losses_spent = self.scaler.losses


class AfterInnerStep:
    """The inner optimizer's first step post-hook: finishes ``amp.optimizer``'s step (masters ->
    model, counters) before any hook of the user's runs. Removed by ``amp.remove()``."""

    def __init__(self, owner: AmpOptimizer) -> None:
        self.owner = owner

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.owner._finish()

    @classmethod
    def attach(cls, owner: AmpOptimizer) -> Callable[[], None]:
        """Register first among the inner optimizer's post-hooks; returns the undo."""
        handle = owner.optimizer.register_step_post_hook(cls(owner))
        owner.optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)
        return handle.remove
