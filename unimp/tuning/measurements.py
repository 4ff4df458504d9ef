"""What only a framework can measure for the tuner, behind ``Backend.tuning()``: the protocol.

Sensitivity itself needs nothing from a backend beyond ``unimp.apply`` and the report. The optional
measurements do: the model's outputs (their divergence), the GEMM shapes of layers, the FP8 GEMM
microbenchmark, and the Hutchinson estimate of Hessian traces (gradients). A backend offers them by returning an object
with these methods from ``Backend.tuning()`` (any subset: a missing one is reported as not
measured, or refused where the user asked for it). unimp-torch's is ``unimp_torch.tune.TorchTuning``.

>>> from unimp.backend import Backend
>>> measurements(type("B", (), {"tuning": Backend.tuning})()) is None
True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

Shape = tuple[int, int, int]  # (M, K, N) of a layer's forward GEMM: rows of its input, in and out features


class Measurements(Protocol):
    """A backend's tuning measurements (every method optional)."""

    def evaluating(self) -> AbstractContextManager[Any]:
        """A context under which ``loss_fn`` evaluations need no gradients (torch: ``torch.no_grad()``)."""

    def record_outputs(self, model: Any) -> AbstractContextManager[Any]:
        """A context that records the outputs of every forward of ``model`` inside it (what it yields is opaque to
        the core: it is passed back to :meth:`output_divergence`)."""

    def output_divergence(self, reference: Any, other: Any) -> float:
        """``||other - reference|| / ||reference||`` over every recorded output (inf when they do not pair up or are
        not finite)."""

    def gemm_shapes(self, model: Any, paths: Sequence[str], run: Callable[[], Any]) -> dict[str, Shape]:
        """The ``(M, K, N)`` of each layer at ``paths`` seen while ``run()`` runs ``model`` once."""

    def fp8_gemm_times(self, model: Any, shapes: Iterable[Shape], recipe: str, compute_dtype: str,
                       gradient_format: str) -> dict[Shape, tuple[float, float]] | str:
        """Per shape the seconds of one training step's GEMMs of such a layer (forward, grad-input,
        grad-weight) in ``compute_dtype`` and in FP8 with ``recipe`` (casts and scaling included), on the
        device ``model`` is on; or why nothing can be measured there (a sentence)."""

    def no_fp8_speed(self, model: Any) -> str | None:
        """Why FP8 speed cannot be measured on the device ``model`` is on (a sentence), or None."""

    def device_kind(self, model: Any) -> str:
        """The kind of device ``model`` is on (a GPU's name, ``cpu``): where speed decisions hold."""

    def fp8_candidate_sets(self, model: Any, paths: Sequence[str], recipe: str) -> dict[str, list[str]]:
        """Named sets of the layers at ``paths`` to try in FP8 together (e.g. the framework's own filters)."""

    def step_seconds(self, model: Any, policy: Any, loss_fn: Callable[[Any, Any], Any], batch: Any,
                     compiled: bool) -> float:
        """Seconds of one training step (forward and backward of ``loss_fn(model, batch)``) of a copy of ``model``
        under ``policy``, compiled as the framework compiles when ``compiled``."""

    def hessian_traces(self, model: Any, loss_fn: Callable[[Any, Any], Any], batches: Sequence[Any],
                       paths: Sequence[str], samples: int, seed: int) -> dict[str, tuple[float, int]]:
        """Per layer at ``paths``: the Hutchinson estimate of the trace of the loss's Hessian with respect
        to its parameters (``samples`` Rademacher vectors per batch) and the number of those parameters."""


def measurements(backend: Any) -> Any:
    """The backend's :class:`Measurements`, or None when it offers none."""
    return backend.tuning()
