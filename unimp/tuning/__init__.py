"""Numerics insight for a policy: which layers are sensitive to lowering, and a policy tuned from that.

:func:`sensitivity` measures, for each layer a policy lowers (bf16/fp16/FP8), the effect of lowering that
layer alone on the user's loss (:class:`unimp.tuning.study.Sensitivity`); :func:`tune` turns that into a
policy file that keeps the sensitive layers high and lowers the rest, each override commented with its
measurements (:class:`unimp.tuning.tuner.Tuned`; ``unimp tune`` on the command line). Framework-free:
everything runs through ``unimp.apply`` on copies of the model; what only a framework can measure (FP8
GEMM speed-ups, Hessian traces) comes from ``Backend.tuning()`` (:mod:`unimp.tuning.measurements`).
The modules load on the first call: ``import unimp`` stays fast.

>>> import unimp
>>> unimp.tune is tune and unimp.sensitivity is sensitivity
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unimp.tuning.study import Sensitivity
    from unimp.tuning.tuner import Tuned

__all__ = ["sensitivity", "tune"]


def sensitivity(policy: Any, model: Any, batches: Any, loss_fn: Callable[[Any, Any], Any], *,
                target: str | None = None, layers: Any = None, max_layers: int = 64, max_batches: int = 8,
                speed: bool = True, hessian_samples: int = 0, seed: int = 0,
                backend: str | None = None) -> Sensitivity:
    """For each layer ``policy`` lowers on ``model``: the effect of lowering that layer alone, measured.

    ``loss_fn(model, batch)`` returns the batch's loss (a float or a 0-d array/tensor; deterministic: eval
    mode); ``batches``: an iterable of at most ``max_batches`` batches. ``target``: ``"fp8"``, ``"bf16"``,
    ``"fp16"`` or None (what the policy lowers to): FP8 layers are compared with the policy's compute dtype,
    bf16/fp16 layers with float32. ``layers``: globs choosing among the candidates; more than ``max_layers``
    candidates is refused. ``speed``: the FP8 GEMM speed-up of each layer's shape on this device (where the
    backend can measure it); ``hessian_samples``: Rademacher vectors per batch for a Hutchinson estimate of
    each layer's Hessian trace (0: none; a backend with gradients: unimp-torch). Runs ``3 + candidates``
    passes over the batches, each on a fresh copy of the model; the model itself is never changed.
    """
    from unimp.tuning.study import Study, check_options

    check_options(speed, hessian_samples, seed)
    study = Study(policy, model, batches, loss_fn, target=target, layers=layers, max_layers=max_layers,
                  max_batches=max_batches, backend=backend)
    return study.measure(speed=speed, hessian_samples=hessian_samples, seed=seed)


def tune(policy: Any, model: Any, batches: Any, loss_fn: Callable[[Any, Any], Any], *, target: str | None = None,
         max_loss_increase: float = 0.01, max_output_divergence: float | None = None, min_speedup: float = 1.0,
         layers: Any = None, max_layers: int = 64, max_batches: int = 8, speed: bool = True, hessian_samples: int = 0,
         seed: int = 0, backend: str | None = None) -> Tuned:
    """A policy from ``policy`` that keeps the layers too sensitive for ``target`` high and lowers the rest.

    Arguments as :func:`sensitivity`. ``max_loss_increase``: the largest divergence (mean relative change of
    the per-batch loss, either way) against the reference that a layer alone, and the tuned policy as a
    whole, may cause. ``max_output_divergence``: the largest relative change of the model's outputs one
    lowered layer may cause (None: what rounding to the format explains, ``u * sqrt(3)``; a larger change
    means values were lost to the format's range; the whole policy may move them ``sqrt(lowered layers)``
    times as far; ``math.inf``: not used). ``min_speedup``: for FP8, a layer whose measured GEMM speed-up is
    below it stays in the compute dtype (unused where not measured). Returns
    :class:`~unimp.tuning.tuner.Tuned` (``.policy``, ``.text``: the commented policy file, ``.write(path)``).
    At most ``log2(candidates) + 2`` runs more than :func:`sensitivity`.
    """
    from unimp.tuning.study import Study, check_options, speed_mode
    from unimp.tuning.tuner import budget, choose

    limit, fastest = budget(max_loss_increase), budget(min_speedup, "min_speedup")
    outputs = None if max_output_divergence is None else budget(max_output_divergence, "max_output_divergence",
                                                                  finite=False)
    check_options(speed, hessian_samples, seed)
    study = Study(policy, model, batches, loss_fn, target=target, layers=layers, max_layers=max_layers,
                  max_batches=max_batches, backend=backend)
    table = study.measure(speed=speed, hessian_samples=hessian_samples, seed=seed)
    return choose(study, table, limit, outputs, fastest, speed_mode(speed) if study.target == "fp8" else None)
