"""The plug-in's adapter class: a :class:`Backend` describes one framework and turns a policy into a Plan
and a Plan into an :class:`unimp.backend.amp.Amp`.

A third-party backend subclasses it and registers it under the entry-point group ``unimp.backends``
(:mod:`unimp.backend.registry`). The module the entry point names must not import its framework at
import time (detection only looks at frameworks already in ``sys.modules``).

>>> Backend.priority, "fp16" in TAGS
(0, True)
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from unimp.backend.transaction import Snapshot
from unimp.plan import Plan, PlanRequest
from unimp.policy import Policy
from unimp.policy.spec import AUTO_INITIAL

if TYPE_CHECKING:
    from unimp.backend.amp import Amp

TAGS = frozenset({
    "fp16", "bf16",  # runs float16 / bfloat16 compute
    "master_weights",  # keeps fp32 masters for low-precision params
    "loss_scaling",  # runs the loss-scale rule in its training step
    "training",  # a real training step (gradients, optimizer update)
    "overrides",  # per-module overrides by path glob and type
    "layout",  # reads layer dims for layout.align findings
    "op_level", "layer_level",  # controls dtypes per op call / per layer
    "static_graph",  # also binds static graphs (e.g. a paddle Program)
    "distributed",  # reduces gradients in distributed.reduce_dtype
    "remove",  # amp.remove() restores the model bit for bit
})


class Backend(abc.ABC):
    """One framework's adapter: a declarative description plus the three methods.

    ``native_ops``: canonical op -> the framework's native names for it (the backend's own table, see
    :func:`unimp.policy.ops.native_table`); ``tags``: the capabilities it declares (from :data:`TAGS`), from
    which the conformance suite selects the checks it must pass (a backend that declares none is held
    to every check).
    """

    name: ClassVar[str]
    framework: ClassVar[str]  # top-level module that must be in sys.modules, e.g. "torch"
    distribution: ClassVar[str]  # pip name, e.g. "unimp-torch"
    model_types: ClassVar[str]  # for messages, e.g. "torch.nn.Module"
    priority: ClassVar[int] = 0  # among backends that accept a model, the highest wins
    native_ops: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    tags: ClassVar[frozenset[str]] = TAGS

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.__dict__.get("tags", ())) - TAGS
        if unknown:
            raise ValueError(f"backend {cls.__name__}: unknown tags {sorted(unknown)}; known: {sorted(TAGS)}")

    @abc.abstractmethod
    def accepts(self, model: Any) -> bool:
        """Whether this backend can apply a policy to ``model``."""

    def compile(self, policy: Policy, model: Any = None) -> Plan:
        """The Plan for ``policy`` on this backend (``model`` gives device/hardware context and the index
        when known): :meth:`plan` on the policy's request. The one place a Policy meets a backend."""
        return self.plan(Plan.request(policy, self.name).starting_at(self.initial_scale()), model)

    def initial_scale(self) -> float:
        """Where this framework's own dynamic loss scaler starts: what a policy's ``loss_scale.initial =
        "auto"`` (the default) starts at here. 2^16 unless a backend says otherwise (torch's ``GradScaler``,
        Flax's ``DynamicScale``, Paddle's ``GradScaler``; Keras' ``LossScaleOptimizer`` starts at 2^15)."""
        return AUTO_INITIAL

    @abc.abstractmethod
    def plan(self, request: PlanRequest, model: Any = None) -> Plan:
        """What this backend will do with ``request`` (:class:`PlanRequest`: the policy as asked):
        ``request.compile(control=..., native=..., ...)`` with what it can control (``model``: the model
        it will bind, when known, for device/hardware context and the per-layer index)."""

    @abc.abstractmethod
    def apply(self, plan: Plan, model: Any, optimizer: Any = None, **options: Any) -> Amp:
        """Bind the plan to ``model`` (+ ``optimizer``); returns the backend's Amp."""

    def snapshot(self, model: Any, optimizer: Any = None, plan: Plan | None = None) -> Snapshot:
        """What ``apply`` may change on ``model`` and ``optimizer``, restored if ``apply`` fails
        (:mod:`unimp.backend.transaction`). The default covers their own attributes; a backend whose
        apply changes submodules or array values names them too (``plan``: the Plan about to be
        applied, e.g. to copy values only where apply casts them in place)."""
        return Snapshot([model, optimizer])

    def scope(self, plan: Plan) -> Any:
        """A context manager building new models under ``plan`` (optional)."""
        from unimp.errors import UnsupportedError

        raise UnsupportedError(f"backend {self.name} has no scope(); build the model, then unimp.apply(...)")

    def conformance_kit(self) -> Any:
        """The backend's :class:`unimp.conformance.Kit` (optional)."""
        raise NotImplementedError(f"backend {self.name} ships no conformance kit")

    def tuning(self) -> Any:
        """What the tuner can measure only through the framework (optional; None: nothing): an object with
        any of the methods of :class:`unimp.tuning.measurements.Measurements` (GEMM shapes, the FP8 GEMM
        microbenchmark, Hutchinson Hessian traces)."""
        return None
