"""What a backend supplies so the conformance checks can drive it (the kit protocol).

Subclass :class:`Kit` in your backend package; every method works on real framework objects
(no mocks). Arrays cross the boundary as numpy.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from unimp.conformance.probe import ProbeBatch
from unimp.dtypes import dtype_name
from unimp.plan import Plan, PlanRequest
from unimp.policy import Policy


@dataclass(frozen=True)
class Observation:
    """One probe layer as seen in a real forward (dtype names as strings)."""

    compute_dtype: str | None
    param_dtype: str | None
    output_dtype: str | None
    fp8: str | None = None  # the FP8 recipe the layer ran (its report row's ``fp8``), None = not FP8


class Kit(abc.ABC):
    """Backend-specific hooks; the checks in :mod:`unimp.conformance.checks` do the rest."""

    backend: str = ""

    @property
    def label(self) -> str:
        """The name this kit's observations go under (``.obs/<label>.json``, the matrix's column): the
        backend's name, or more where one backend runs on several frameworks (``keras-jax``)."""
        return self.backend

    @property
    def tags(self) -> frozenset[str]:
        """The capability tags of the backend under test (its Backend class declares them); the suite
        runs the checks they allow (:mod:`unimp.conformance.select`)."""
        from unimp.backend import TAGS
        from unimp.backend.registry import backends

        cls = backends().get(self.backend)
        return frozenset(cls.tags) if cls is not None else TAGS

    def supports(self, request: PlanRequest) -> str | None:
        """Why the policy of ``request`` (:class:`unimp.plan.PlanRequest`) cannot run here (the check then
        expects a clear UnsupportedError); None when it can."""
        return None

    @staticmethod
    def with_fallback(policy: Policy) -> Policy:
        """``policy`` with ``on_unsupported = "fallback"`` (the same policy otherwise): what a kit applies
        where the platform cannot honour it, so the Plan reports every fallback."""
        return policy.replace(on_unsupported="fallback")

    def why_not(self, policy: Policy) -> str | None:
        """:meth:`supports` for ``policy`` (what the checks call)."""
        return self.supports(Plan.request(policy, self.backend))

    @abc.abstractmethod
    def build_probe(self, weights: dict[str, Any]) -> Any:
        """A fresh float32 probe model (see :mod:`unimp.conformance.probe`) with these weights."""

    @abc.abstractmethod
    def make_optimizer(self, model: Any, lr: float = 1e-2) -> Any:
        """An Adam optimizer (with moments, so skipped steps are visible) over the model."""

    def make_sgd(self, model: Any, lr: float = 0.1) -> Any:
        """Plain SGD (no momentum): the same update rule in every framework, used for the
        cross-framework loss curves (Adam's epsilon placement differs, e.g. in Keras)."""
        raise NotImplementedError(f"{type(self).__name__}.make_sgd")

    def apply(self, policy: Policy, model: Any, optimizer: Any) -> Any:
        import unimp

        return unimp.apply(policy, model, optimizer, backend=self.backend)

    def backend_instance(self) -> Any:
        """The :class:`~unimp.backend.Backend` under test (from the registry)."""
        from unimp.backend.registry import get_backend

        return get_backend(self.backend)

    def compile(self, policy: Policy, model: Any) -> Any:
        """The backend's Plan for ``policy`` on ``model`` (the model ``build_probe`` returned)."""
        return self.backend_instance().compile(policy, model)

    def apply_plan(self, plan: Any, model: Any, optimizer: Any) -> Any:
        """Bind a given Plan (as ``Backend.apply`` does, without compiling again)."""
        return self.backend_instance().apply(plan, model, optimizer)

    @abc.abstractmethod
    def observe(self, amp: Any, batch: ProbeBatch) -> dict[str, Observation]:
        """Per probe layer path, what ran in one real forward under ``amp`` (:meth:`observations` of its report)."""

    @staticmethod
    def observations(report: Any) -> dict[str, Observation]:
        """Per row of an ``amp.report(...)``: what ran, as an :class:`Observation`."""
        return {r.path: Observation(r.compute_dtype, r.param_dtype, r.output_dtype, r.fp8) for r in report.rows}

    @abc.abstractmethod
    def output(self, amp: Any, batch: ProbeBatch) -> Any:
        """The model's output for ``batch`` under ``amp`` as a framework tensor/array."""

    def dtype_name(self, value: Any) -> str:
        """The dtype of a framework tensor/array as unimp's string (``"bfloat16"``; by default from the text of
        ``value.dtype``: :func:`unimp.dtypes.dtype_name`)."""
        return dtype_name(value.dtype)

    @abc.abstractmethod
    def step(self, amp: Any, batch: ProbeBatch, poison: bool = False) -> float:
        """One training step through the backend's idiomatic loop; returns the loss.

        ``poison`` makes this step's gradients non-finite (e.g. multiplies the loss by inf).
        """

    @abc.abstractmethod
    def snapshot(self, amp: Any) -> dict[str, Any]:
        """Every parameter, master weight and optimizer-state tensor as numpy (exact bits)."""

    @abc.abstractmethod
    def master_pairs(self, amp: Any) -> list[tuple[str, Any, Any]]:
        """``(name, low-precision param as float32 numpy, fp32 master numpy)`` per parameter
        that has a master; [] when there are none."""

    @abc.abstractmethod
    def model_state(self, model: Any) -> dict[str, tuple[str, Any]]:
        """Everything ``remove()`` must restore: name -> (dtype name, numpy values)."""

    def export_weights(self, amp: Any) -> dict[str, Any]:
        """The probe's current weights as float32 numpy in the probe layout (``"fc1.weight"`` is
        ``(in, out)``), from the fp32 masters where there are any — what another framework's
        :meth:`build_probe` takes to resume the run."""
        raise NotImplementedError(f"{type(self).__name__}.export_weights")

    def forward_fingerprint(self, model: Any, batch: ProbeBatch) -> Any:
        """The plain model's output as numpy (to prove ``remove()`` restored the forward)."""
        raise NotImplementedError
