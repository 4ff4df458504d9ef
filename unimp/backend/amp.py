"""The :class:`Amp` handle a backend's ``apply`` returns: the policy bound to one model (+ optimizer), with
the same attributes in every backend (loss-scale state, state dicts, reports, watch, remove).

>>> issubclass(Amp, object), STATE_FORMAT
(True, 'unimp.amp/1')
"""

from __future__ import annotations

import abc
import copy
import functools
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from unimp.backend.applied import any_applied, is_applied, release, remember
from unimp.dtypes import FLT_MAX
from unimp.errors import StateError, UnimpWarning, UnsupportedError
from unimp.loss_scale import STATE_KEYS, LossScaleState, check_state, policy_problems
from unimp.plan import Plan
from unimp.policy import LossScaleSpec, Policy
from unimp.report import Report, ReportRow
from unimp.watch import Watch
from unimp.watch.writer import ScalarWriter

STATE_FORMAT = "unimp.amp/1"


class NoForwardError(StateError, RuntimeError):
    """``amp.report()`` without inputs before any forward ran under the Amp."""


def _live_only(method: Any, verb: str) -> Any:
    @functools.wraps(method)
    def guarded(self: Amp, *args: Any, **kwargs: Any) -> Any:
        self._check_live(verb)
        return method(self, *args, **kwargs)

    guarded._live_checked = True  # type: ignore[attr-defined]
    return guarded


class Amp(abc.ABC):
    """The policy bound to one model (+ optimizer); the same attributes in every backend."""

    backend: str

    _GUARDED: ClassVar[tuple[str, ...]] = ("loss_scale_state", "set_loss_scale_state", "report")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A backend's own contract methods refuse after :meth:`remove` too (see :meth:`_check_live`)."""
        super().__init_subclass__(**kwargs)
        for name in cls._GUARDED:
            method = cls.__dict__.get(name)
            if callable(method) and not getattr(method, "_live_checked", False):
                setattr(cls, name, _live_only(method, f"amp.{name}()"))

    def check_loss_dtype(self, dtype: str) -> None:
        """Warn (once per Amp) when a loss reaches the Amp in a low-precision dtype while the policy runs
        ``loss`` in float32: it was computed outside the policy, on outputs the policy leaves in the
        compute dtype (``output_dtype = "unchanged"``, as native autocast leaves them). Backends call
        it with the loss's dtype name where the loss enters (``amp.backward``, ``amp.value_and_grad``)."""
        if dtype not in ("float16", "bfloat16") or self.policy.ops.category("loss") != "float32" or \
                self.__dict__.get("_warned_loss_dtype"):
            return
        self._warned_loss_dtype = True
        warnings.warn(
            f"unimp ({self.backend}): the loss reached the Amp in {dtype}, but the policy runs `loss` in "
            f"float32: it was computed outside the policy on the model's {dtype} outputs (output_dtype = "
            f"{self.policy.output_dtype!r} leaves them as the last op ran, as torch.autocast does). Cast the "
            f"outputs to float32 before the loss (e.g. `F.cross_entropy(logits.float(), y)`), compute the "
            f"loss inside the model, or set output_dtype = \"float32\"", UnimpWarning, stacklevel=3)

    def __init__(self, plan: Plan, model: Any, optimizer: Any = None) -> None:
        self.plan = plan
        self.backend = plan.backend
        self.model = model
        self.optimizer = optimizer
        self.findings: list[str] = []  # layout / alignment findings, with module paths
        self._removed = False
        self._watch: Watch | None = None  # the last amp.watch(), running or closed (its numerics stay in reports)

    @property
    def policy(self) -> Policy:
        """The policy this Amp applies (for users and the core; a backend reads ``self.plan``)."""
        return self.plan.policy

    # ------------------------------------------------------------------ to implement
    @abc.abstractmethod
    def loss_scale_state(self) -> LossScaleState:
        """The canonical loss-scale state (may sync with the device)."""

    @abc.abstractmethod
    def set_loss_scale_state(self, state: LossScaleState) -> None:
        """Replace the loss-scale state."""

    @abc.abstractmethod
    def report(self, *inputs: Any) -> Report:
        """What actually ran, from a real forward: with ``inputs``, a forward on them; without, the
        last forward run under this Amp (:meth:`no_forward` when there was none). Never empty rows."""

    @abc.abstractmethod
    def _restore(self) -> None:
        """Undo everything ``apply`` did to the user's objects."""

    def _start_watch(self, watch: Watch) -> None:
        """Start measuring for ``watch`` (:class:`unimp.watch.Watch`): call ``watch.bind(next_step, stop)``,
        then ``watch.add(...)`` for each sampled or skipped step. A backend without a watch keeps this."""
        raise UnsupportedError(f"amp.watch(): the {self.backend} backend has no numerics watch yet; watch a torch "
                               f"or JAX run, or read amp.report() for the dtypes that ran")

    def _tensorboard_writer(self, logdir: Any) -> Any:
        """The framework's TensorBoard-style writer at ``logdir`` (``add_scalar``/``add_text``/``flush``/``close``,
        as :class:`unimp.watch.writer.ScalarWriter` drives it), where the framework has one."""
        raise UnsupportedError(f"amp.watch(tensorboard=...): the {self.backend} backend has no TensorBoard writer; "
                               f"use amp.watch(path='numerics.jsonl') (JSON lines) and plot those")

    # ------------------------------------------------------------------ shared
    def watch(self, every: int = 100, path: Any = None, *, localize: bool = False, keep: int = 1000,
              tensorboard: Any = None) -> Watch:
        """Watch the numerics of training under this Amp (off until called); returns the :class:`unimp.watch.Watch`.

        One step in ``every`` (the next step, then every ``every``-th) records per layer the largest
        finite magnitude of its output and of the gradient arriving at it, and the fractions of their
        values that are non-finite, overflow, underflow, are subnormal or zero in the layer's compute
        dtype (FP8 layers: also their input and output gradient in the FP8 formats). A step the loss scaler skips is
        recorded too, with where its first non-finite value appeared: exactly (layer, forward or
        backward, in execution order) with ``localize=True``, which checks every layer on every step,
        else from the parameter gradients the skipped step left. Records are plain dicts
        (``watch.records``, the last ``keep``), appended as JSON lines to ``path`` and written to
        TensorBoard at ``tensorboard`` (a log directory) where the framework has a writer;
        ``amp.report().numerics`` folds them per layer. Stop with ``watch.close()`` or :meth:`unwatch`.
        """
        self._check_live("amp.watch()")
        running = getattr(self, "_watch", None)
        if running is not None and not running.closed:
            raise UnsupportedError("amp.watch(): a watch is already running on this Amp; stop it first "
                                   "(amp.unwatch() or watch.close()), then start the new one")
        watch = Watch(every, path, localize=localize, keep=keep)  # the arguments checked before anything opens
        try:
            if tensorboard is not None:
                watch.add_writer(ScalarWriter(self._tensorboard_writer(tensorboard)))
            self._start_watch(watch)
        except BaseException:
            watch.close()  # its file and writers closed; the backend undid its own part
            raise
        self._watch = watch
        return watch

    def unwatch(self) -> Watch | None:
        """Stop the running watch (its hooks removed, its file closed); returns it (None if none ran)."""
        self._check_live("amp.unwatch()")
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.close()
        return watch

    def _check_live(self, verb: str) -> None:
        """Refuse ``verb`` (e.g. ``"amp.optimizer.step()"``) once :meth:`remove` has run.

        Every verb of an Amp and of the handles it gave out (optimizer, step functions) calls this first.
        """
        if getattr(self, "_removed", False):
            raise StateError(f"{verb}: this Amp was removed (amp.remove() restored the model); apply the policy "
                             f"again to use it: amp = unimp.apply(policy, model, optimizer)")

    def applied(self) -> bool:
        """Whether this Amp is in force: not removed, and its model still marked applied (an ``unimp.apply``
        rolled back after the backend's part returned is not)."""
        return not getattr(self, "_removed", False) and any_applied(getattr(self, "_applied_ids", [id(self.model)]))

    @property
    def scale(self) -> float:
        self._check_live("amp.scale")
        return self.loss_scale_state().scale

    @property
    def skipped_steps(self) -> int:
        self._check_live("amp.skipped_steps")
        return self.loss_scale_state().skipped

    def state_dict(self) -> dict[str, Any]:
        """Canonical, framework-free state: plain numbers plus the policy fingerprint."""
        self._check_live("amp.state_dict()")
        return {"format": STATE_FORMAT, "policy_fingerprint": self.policy.fingerprint,
                **self.loss_scale_state().to_dict()}

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore state saved by any backend; ``strict`` refuses another policy's state.

        ``strict=False`` relaxes only where the state came from (the fingerprint may differ or be
        absent, with a warning): every value is still checked against this Amp's rule
        (:func:`unimp.loss_scale.policy_problems`), so nothing loads that the rule would not produce.

        The whole dict is checked first (one :class:`StateError` naming every bad key, its value and the
        fix); then it is applied all at once: a backend that fails half-way is rolled back.
        """
        self._check_live("amp.load_state_dict()")
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            got = f"format {state.get('format')!r:.60}" if isinstance(state, Mapping) else type(state).__name__
            raise StateError(f"amp.load_state_dict(): not an unimp state_dict (got {got}; expected format "
                             f"{STATE_FORMAT!r} and keys {', '.join(STATE_KEYS)}); pass what amp.state_dict() "
                             f"returned")
        problems = check_state(state)
        fp = state.get("policy_fingerprint")
        if not problems:  # strict or not: strict=False takes another policy's state, never one this rule can't run
            problems = self._policy_problems(LossScaleState.from_dict(state))
        same = self.policy.loads_state_of(fp)
        if not same and strict:
            raise StateError(f"amp.load_state_dict(): state_dict was saved under policy fingerprint {fp!r:.60}, "
                             f"this Amp uses {self.policy.fingerprint} ({self.policy.name}); load the same "
                             + ("policy" if problems else "policy, or pass strict=False to take the loss-scale "
                                                          "state anyway")
                             + "".join(f"; {p}" for p in problems))
        if problems:
            raise StateError("amp.load_state_dict(): " + "; ".join(problems))
        if not same:
            warnings.warn(f"amp.load_state_dict(strict=False): state_dict was saved under policy fingerprint "
                          f"{fp!r:.60}, this Amp uses {self.policy.fingerprint} ({self.policy.name}); its "
                          f"loss-scale state is taken", UnimpWarning, stacklevel=2)
        self._apply_state(LossScaleState.from_dict(state))

    @staticmethod
    def fp8_state_problems(current: Mapping[str, list[float]], plain: Any) -> list[str]:
        """Why ``plain`` (a saved state_dict's ``fp8``) cannot load as the FP8 scaling state ``current``
        (``{"layer.path.name": [floats]}``, as this Amp's ``state_dict()`` writes it); each names the key.

        >>> Amp.fp8_state_problems({"fc.input_scale": [1.0]}, {"fc.input_scale": [-1.0]})
        ['fp8.fc.input_scale: expected 1 finite non-negative numbers, got [-1.0]']
        """
        if not isinstance(plain, Mapping):
            return [f"fp8: expected a mapping from amp.state_dict(), got {type(plain).__name__}"]
        problems = [f"fp8.{k}: {'missing' if k in current else 'unknown'} (this Amp's FP8 layers hold "
                    f"{len(current)} state arrays; save and load with the same model and policy)"
                    for k in sorted(set(current) ^ set(plain))]
        for k in sorted(set(current) & set(plain)):
            v = plain[k]
            if not (isinstance(v, list | tuple) and len(v) == len(current[k]) and all(
                    isinstance(x, int | float) and not isinstance(x, bool) and 0 <= x <= FLT_MAX for x in v)):
                problems.append(f"fp8.{k}: expected {len(current[k])} finite non-negative numbers, got {str(v)[:60]}")
        return problems

    def _policy_problems(self, st: LossScaleState) -> list[str]:
        """What in a well-formed state this Amp's rule cannot hold or never produces
        (:func:`unimp.loss_scale.policy_problems`, on the spec this backend runs)."""
        return policy_problems(self._loss_scale_run(), st)

    def _loss_scale_run(self) -> LossScaleSpec:
        """The loss-scale knobs this backend really runs: the Plan's resolved spec, with the fallbacks
        its notes name (a backend that falls back overrides this)."""
        return self.plan.loss_scale

    def _apply_state(self, new: LossScaleState) -> None:
        """``set_loss_scale_state(new)`` all or nothing: on failure the previous state is put back."""
        old = self.loss_scale_state()
        try:
            self.set_loss_scale_state(new)
        except Exception as e:
            try:
                self.set_loss_scale_state(old)
            except Exception:  # pragma: no cover - the backend cannot even restore what it reported
                pass
            if isinstance(e, StateError):
                raise
            raise StateError(f"amp.load_state_dict(): the {self.backend} backend cannot hold {new} "
                             f"({type(e).__name__}: {e}); nothing was changed") from e

    def remove(self) -> Any:
        """Undo ``apply``: the model's forward, dtypes and parameters are restored exactly.

        Once: a second call returns the model. Two threads removing one Amp at the same time: one
        removes it, the other gets a :class:`StateError` (the model stays marked applied until the
        removal is done, so an ``unimp.apply`` racing it is refused too)."""
        if self._removed:
            return self.model
        mine = object()
        if self.__dict__.setdefault("_removing", mine) is not mine:  # atomic: one remover wins
            raise StateError(f"amp.remove(): another thread is removing this Amp ({type(self.model).__name__} "
                             f"id 0x{id(self.model):x}) right now; remove it from one thread, then apply again")
        try:
            watch = getattr(self, "_watch", None)
            if watch is not None:
                watch.close()
            self._restore()
            release(getattr(self, "_applied_ids", [id(self.model)]))
            self._removed = True
        except BaseException:
            del self.__dict__["_removing"]  # not removed: it may be tried again
            raise
        return self.model

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        """An independent Amp over deep copies of the model and optimizer (same state).

        Refused with :class:`UnsupportedError` (naming the fix) when the backend's objects cannot be copied.
        """
        self._check_live("copy.deepcopy(amp)")
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        try:
            # the copy is not watched (a watch holds a file and hooks on this Amp's model)
            own = ("_applied_ids", "_watch", "_removing")
            state = copy.deepcopy({k: v for k, v in vars(self).items() if k not in own}, memo)
        except Exception as e:
            raise UnsupportedError(
                f"copy.deepcopy(amp): the {self.backend} backend's objects cannot be copied "
                f"({type(e).__name__}: {str(e)[:200]}); fix: copy the unwrapped model and apply again: "
                f"new = unimp.apply(amp.policy, model_copy, new_optimizer); "
                f"new.load_state_dict(amp.state_dict())") from None
        vars(new).update(state)
        new._watch = None
        copies = [memo[i] for i in getattr(self, "_applied_ids", [id(self.model)]) if i in memo]
        new._applied_ids = remember(*(copies or [new.model]))
        return new

    def bind_also(self, *objects: Any) -> None:
        """Mark more objects as bound to this Amp (a compiled or distributed wrapper made from its model),
        so a second ``unimp.apply`` on them is refused; :meth:`remove` releases them."""
        self._applied_ids = [*getattr(self, "_applied_ids", []), *remember(*objects)]

    @staticmethod
    def is_bound(obj: Any) -> bool:
        """Whether ``obj`` is bound to some live Amp (``unimp.apply`` on it would be refused)."""
        return is_applied(obj)

    def no_forward(self, hint: str = "") -> NoForwardError:
        """The one error of ``amp.report()`` without inputs when no forward has run under this Amp."""
        return NoForwardError("amp.report(): no forward has run under this Amp yet; run amp.model(x) once first, "
                              "or pass an example input: amp.report(x)" + (f" ({hint})" if hint else ""))

    def report_header(self, rows: list[ReportRow], notes: list[str] | None = None) -> Report:
        """A Report with the counters filled from the loss-scale state (and the Plan's FP8 fallback, if any)."""
        self._check_live("amp.report()")
        st = self.loss_scale_state()
        fp8 = self.plan.fp8
        fallback = [f"fp8: fallback to the compute dtype: {fp8.fallback}"] if fp8 is not None and fp8.fallback else []
        watch = getattr(self, "_watch", None)
        return Report(rows=rows, backend=self.backend, policy=self.policy.name,
                      fingerprint=self.policy.fingerprint, scale=st.scale, skipped_steps=st.skipped,
                      steps=st.steps, notes=list(notes or []) + fallback + list(self.findings),
                      numerics=watch.numerics() if watch is not None else None)

    def __repr__(self) -> str:
        return f"<unimp.Amp backend={self.backend} policy={self.policy.name!r} removed={self._removed}>"
