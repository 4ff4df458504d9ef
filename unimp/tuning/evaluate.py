"""Running the user's ``loss_fn`` under one policy: a fresh copy of the model, ``unimp.apply``, the loss of
every batch, ``amp.remove()``; and the two ways two such runs are compared.

Every run starts from a ``copy.deepcopy`` of the user's model, so a run cannot change the model the
next one sees (running statistics, a failure half-way) and the user's model is never touched. The
batches are read once and bounded (``max_batches``).

>>> change([2.0, 2.0], [2.5, 1.75]), divergence([2.0, 2.0], [2.5, 1.75])
(0.0625, 0.1875)
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from unimp.backend import NoForwardError
from unimp.backend.registry import apply
from unimp.errors import TuneError
from unimp.policy import Policy
from unimp.policy.spec import show
from unimp.report import Report
from unimp.tuning.measurements import measurements

LossFn = Callable[[Any, Any], Any]


@dataclass(frozen=True)
class Run:
    """The loss of each batch under one policy (and what ran, when asked)."""

    policy: Policy
    losses: tuple[float, ...]
    report: Report | None = None
    output_divergence: float | None = None  # against the baseline run's outputs, where the backend records them
    outputs: Any = None  # the recorded outputs, when kept (opaque: the backend's)

    @property
    def mean(self) -> float:
        return math.fsum(self.losses) / len(self.losses)


def change(reference: Sequence[float], other: Sequence[float]) -> float:
    """The relative change of the mean loss: ``(mean(other) - mean(ref)) / mean(|ref|)`` (signed)."""
    return (math.fsum(other) - math.fsum(reference)) / _scale(reference)


def divergence(reference: Sequence[float], other: Sequence[float]) -> float:
    """The mean over batches of ``|other - ref|``, relative to the mean ``|ref|``: a change either way counts
    (a perturbed model may lower the loss of a batch by chance; that is no evidence it is harmless)."""
    if not all(math.isfinite(x) for x in other):
        return math.inf
    return math.fsum(abs(o - r) for r, o in zip(reference, other, strict=True)) / _scale(reference)


def _scale(reference: Sequence[float]) -> float:
    return math.fsum(abs(r) for r in reference)


def loss_value(value: Any, batch: int) -> float:
    """``loss_fn``'s result as a Python float (a float, or a 0-d array/tensor)."""
    if isinstance(value, bool):
        value = None
    try:
        return float(value)
    except Exception:  # any framework's "not a scalar" error says the same thing
        raise TuneError(f"loss_fn returned {show(value)} for batches[{batch}]; it must return the batch's loss as "
                        f"a float or a 0-d array/tensor (e.g. `return loss` for a scalar tensor, or "
                        f"`loss.item()`)") from None


def check_count(name: str, value: Any, minimum: int = 1, maximum: int | None = None) -> int:
    """An integer argument in ``[minimum, maximum]``, else a :class:`TuneError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
            maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise TuneError(f"{name}={show(value)}: expected an integer >= {minimum}{upper}")
    return value


def read_batches(batches: Any, max_batches: int) -> tuple[Any, ...]:
    """At most ``max_batches`` batches from any iterable, read once (more is refused, naming the fix)."""
    check_count("max_batches", max_batches)
    if isinstance(batches, str | bytes) or not isinstance(batches, Iterable):
        raise TuneError(f"batches={show(batches)}: expected an iterable of batches (a list, a tuple, a generator); "
                        f"each is passed to loss_fn(model, batch)")
    taken = tuple(itertools.islice(iter(batches), max_batches + 1))
    if not taken:
        raise TuneError("batches is empty: pass at least one batch (each is passed to loss_fn(model, batch))")
    if len(taken) > max_batches:
        raise TuneError(f"batches holds more than max_batches={max_batches} batches; each policy runs every batch, "
                        f"so pass fewer (e.g. itertools.islice(loader, {max_batches})) or raise max_batches")
    return taken


class Evaluator:
    """``loss_fn`` over the batches under any policy, on a fresh copy of ``model`` each time."""

    def __init__(self, model: Any, batches: tuple[Any, ...], loss_fn: LossFn, backend: Any) -> None:
        if not callable(loss_fn):
            raise TuneError(f"loss_fn={show(loss_fn)}: expected a callable loss_fn(model, batch) returning the "
                            f"batch's loss (a float or a 0-d array/tensor)")
        self.model, self.batches, self.loss_fn, self.backend = model, batches, loss_fn, backend
        self.hooks = measurements(backend)
        self.runs = 0
        self.baseline: Any = None  # the outputs runs are compared with (a kept Run.outputs; opaque: the backend's)

    @property
    def records_outputs(self) -> bool:
        """Whether the backend records model outputs (then every run has an output divergence)."""
        return all(hasattr(self.hooks, m) for m in ("record_outputs", "output_divergence"))

    def copy(self) -> Any:
        """A deep copy of the user's model (what every run starts from)."""
        try:
            return copy.deepcopy(self.model)
        except Exception as e:  # whatever the framework raises, the fix is the same
            raise TuneError(f"model: copy.deepcopy failed ({type(e).__name__}: {str(e)[:200]}); sensitivity runs "
                            f"each policy on a copy of the model, so pass a model that can be deep-copied "
                            f"(e.g. not compiled or wrapped)") from None

    def evaluating(self) -> Any:
        """The backend's no-gradient context for evaluations (a null context when it has none)."""
        hook = getattr(self.hooks, "evaluating", None)
        return hook() if hook is not None else contextlib.nullcontext()

    def run(self, policy: Policy, report: bool = False, keep: bool = False) -> Run:
        """The loss of every batch with ``policy`` applied and the divergence of the model's outputs from the
        :attr:`baseline`'s (once set); ``report``: also what ran (from the last forward); ``keep``: also the
        recorded outputs (``Run.outputs``: e.g. to become the baseline)."""
        model = self.copy()
        amp = apply(policy, model, backend=self.backend.name)
        record = self.records_outputs and (keep or self.baseline is not None)
        try:
            with self.evaluating(), (self.hooks.record_outputs(amp.model) if record
                                     else contextlib.nullcontext()) as outputs:
                losses = tuple(loss_value(self.loss_fn(amp.model, b), i) for i, b in enumerate(self.batches))
            seen = self._report(amp) if report else None
        finally:
            amp.remove()
        self.runs += 1
        return Run(policy, losses, seen, self.compare(outputs) if record else None, outputs if keep else None)

    @staticmethod
    def _report(amp: Any) -> Report:
        try:
            report: Report = amp.report()
            return report
        except NoForwardError:
            raise TuneError("loss_fn never ran the model it was given (amp.report() saw no forward): loss_fn(model, "
                            "batch) must compute the batch's loss with model") from None

    def compare(self, outputs: Any) -> float | None:
        """The divergence of recorded ``outputs`` from the :attr:`baseline`'s (None before there is one)."""
        return None if self.baseline is None else self.hooks.output_divergence(self.baseline, outputs)
