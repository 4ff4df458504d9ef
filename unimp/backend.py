"""The plug-in contract: a small :class:`Backend` class and the :class:`Amp` handle it returns.

A third-party backend subclasses both and registers the Backend under the entry-point group
``unimp.backends``. The module the entry point names must not import its framework at import
time (detection only looks at frameworks already in ``sys.modules``).

>>> issubclass(Amp, object) and Backend.priority
0
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

from .errors import StateError, UnimpWarning
from .loss_scale import STATE_KEYS, LossScaleState
from .plan import Plan
from .policy import Policy
from .report import Report

STATE_FORMAT = "unimp.amp/1"


class Backend(abc.ABC):
    """One framework's adapter. Subclasses set the class attributes and the three methods."""

    name: ClassVar[str]
    framework: ClassVar[str]  # top-level module that must be in sys.modules, e.g. "torch"
    distribution: ClassVar[str]  # pip name, e.g. "unimp-torch"
    model_types: ClassVar[str]  # for messages, e.g. "torch.nn.Module"
    priority: ClassVar[int] = 0  # among backends that accept a model, the highest wins

    @abc.abstractmethod
    def accepts(self, model: Any) -> bool:
        """Whether this backend can apply a policy to ``model``."""

    @abc.abstractmethod
    def compile(self, policy: Policy, model: Any = None) -> Plan:
        """The Plan for ``policy`` (``model`` gives device/hardware context when known)."""

    @abc.abstractmethod
    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        """Bind the plan to ``model`` (+ ``optimizer``); returns the backend's Amp."""

    def scope(self, policy: Policy) -> Any:
        """A context manager building new models under ``policy`` (optional)."""
        from .errors import UnsupportedError

        raise UnsupportedError(f"backend {self.name} has no scope(); build the model, then unimp.apply(...)")

    def conformance_kit(self) -> Any:
        """The backend's :class:`unimp.conformance.Kit` (optional)."""
        raise NotImplementedError(f"backend {self.name} ships no conformance kit")


class Amp(abc.ABC):
    """The policy bound to one model (+ optimizer); the same attributes in every backend."""

    backend: str

    def __init__(self, plan: Plan, model: Any, optimizer: Any = None) -> None:
        self.plan = plan
        self.policy: Policy = plan.policy
        self.backend = plan.backend
        self.model = model
        self.optimizer = optimizer
        self.findings: list[str] = []  # layout / alignment findings, with module paths
        self._removed = False

    # ------------------------------------------------------------------ to implement
    @abc.abstractmethod
    def loss_scale_state(self) -> LossScaleState:
        """The canonical loss-scale state (may sync with the device)."""

    @abc.abstractmethod
    def set_loss_scale_state(self, state: LossScaleState) -> None:
        """Replace the loss-scale state."""

    @abc.abstractmethod
    def report(self) -> Report:
        """What actually ran, from a real forward."""

    @abc.abstractmethod
    def _restore(self) -> None:
        """Undo everything ``apply`` did to the user's objects."""

    # ------------------------------------------------------------------ shared
    @property
    def scale(self) -> float:
        return self.loss_scale_state().scale

    @property
    def skipped_steps(self) -> int:
        return self.loss_scale_state().skipped

    def state_dict(self) -> dict[str, Any]:
        """Canonical, framework-free state: plain numbers plus the policy fingerprint."""
        return {"format": STATE_FORMAT, "policy_fingerprint": self.policy.fingerprint,
                **self.loss_scale_state().to_dict()}

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Restore state saved by any backend; ``strict`` refuses another policy's state."""
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise StateError(f"not an unimp state_dict (expected format {STATE_FORMAT!r} and keys "
                             f"{', '.join(STATE_KEYS)})")
        fp = state.get("policy_fingerprint")
        if fp != self.policy.fingerprint:
            msg = (f"state_dict was saved under policy fingerprint {fp}, this Amp uses "
                   f"{self.policy.fingerprint} ({self.policy.name}); load the same policy, or pass "
                   f"strict=False to take the loss-scale state anyway")
            if strict:
                raise StateError(msg)
            warnings.warn(msg, UnimpWarning, stacklevel=2)
        self.set_loss_scale_state(LossScaleState.from_dict(dict(state)))

    def remove(self) -> Any:
        """Undo ``apply``: the model's forward, dtypes and parameters are restored exactly."""
        from .registry import release

        if not self._removed:
            self._restore()
            release(getattr(self, "_applied_ids", [id(self.model)]))
            self._removed = True
        return self.model

    def report_header(self, rows: list, notes: list[str] | None = None) -> Report:
        """A Report with the counters filled from the loss-scale state."""
        st = self.loss_scale_state()
        return Report(rows=rows, backend=self.backend, policy=self.policy.name,
                      fingerprint=self.policy.fingerprint, scale=st.scale, skipped_steps=st.skipped,
                      steps=st.steps, notes=list(notes or []) + list(self.findings))

    def __repr__(self) -> str:
        return f"<unimp.Amp backend={self.backend} policy={self.policy.name!r} removed={self._removed}>"
