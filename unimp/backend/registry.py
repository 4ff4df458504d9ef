"""Backend discovery (entry points, lazily, through ``sys.modules``) and :func:`apply`.

>>> import unimp
>>> try:
...     unimp.apply("mixed_bf16", object())
... except TypeError as e:
...     print(str(e).split(";")[0])
no unimp backend accepts <class 'object'>
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from unimp.backend.adapter import Backend
from unimp.backend.amp import Amp
from unimp.backend.applied import Journal, already_applied, claim, is_applied
from unimp.backend.transaction import Snapshot, all_or_nothing
from unimp.errors import UnimpWarning, UnsupportedError
from unimp.plan import Plan
from unimp.policy import Policy
from unimp.policy.loading import load

GROUP = "unimp.backends"
HINTS = {"torch": "unimp-torch (torch.nn.Module)", "flax": "unimp-jax (Flax nnx/linen Module)",
         "jax": "unimp-jax (Flax nnx/linen Module)", "keras": "unimp-keras (Keras 3 model, any Keras backend)",
         "tensorflow": "unimp-keras (Keras 3 model, any Keras backend)",
         "tf_keras": "unimp-keras (Keras 3 models: pip install 'keras>=3', build with `import keras`, not tf_keras)",
         "paddle": "unimp-paddle (paddle.nn.Layer or paddle.static.Program)"}

_registered: dict[str, type[Backend]] = {}
_loaded: dict[str, type[Backend]] | None = None
_candidates: dict[type, tuple[str, ...]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Register a backend class directly (entry points do this for installed packages)."""
    _registered[cls.name] = cls
    _candidates.clear()
    return cls


def backends() -> dict[str, type[Backend]]:
    """Every known backend class by name (entry points are read once)."""
    global _loaded
    if _loaded is None:
        from importlib.metadata import entry_points

        found: dict[str, type[Backend]] = {}
        for ep in entry_points(group=GROUP):
            try:
                found[ep.name] = ep.load()
            except Exception as e:  # a broken plug-in must not break the others
                print(f"unimp: backend {ep.name!r} failed to load: {e}", file=sys.stderr)
        _loaded = found
    return {**_loaded, **_registered}


def get_backend(name: str) -> Backend:
    """The backend called ``name``; a clear error naming what is installed otherwise."""
    known = backends()
    if name not in known:
        raise UnsupportedError(f"backend {name!r} is not installed (installed: "
                               f"{', '.join(sorted(known)) or 'none'}); pip install unimp-{name}")
    return known[name]()


def detect(model: Any) -> Backend:
    """The backend for ``model``: among those whose framework is imported, the best that accepts it."""
    t = type(model)
    if t not in _candidates:
        _candidates[t] = tuple(n for n, b in backends().items() if b.framework in sys.modules)
    known = backends()
    accepting = [known[n]() for n in _candidates[t]]
    accepting = [b for b in accepting if b.accepts(model)]
    if accepting:
        return max(accepting, key=lambda b: b.priority)
    root = t.__module__.split(".")[0]
    hint = HINTS.get(root)
    tail = f"; install {hint}" if hint else ""
    raise TypeError(f"no unimp backend accepts {t!r}; installed backends: "
                    f"{', '.join(sorted(known)) or 'none'}{tail}")


def apply(policy: Any, model: Any, optimizer: Any = None, *, backend: str | None = None,
          **options: Any) -> Amp:
    """Bind a policy (file, preset name, dict or Policy) to a model and optimizer.

    The backend is detected from the model's type unless ``backend`` names one. If applying
    fails, the model and optimizer are left exactly as they were (``Backend.snapshot``). A compiled
    :class:`~unimp.plan.Plan` is bound as it is, on its own backend (e.g. one a ``scope`` compiled).
    """
    plan = policy if isinstance(policy, Plan) else None
    if plan is not None:
        backend = plan.backend
    else:
        policy = load(policy)
    if is_applied(model):
        raise already_applied(model)
    chosen = get_backend(backend) if backend else detect(model)
    if backend and not chosen.accepts(model):
        raise TypeError(f"backend {backend!r} does not accept {type(model)!r} (it takes "
                        f"{chosen.model_types})")
    if plan is None:
        plan = chosen.compile(policy, model)
        tuned_elsewhere(chosen, policy, model)
    # one transaction (unimp.backend.transaction): the claim on the model first (of two threads applying
    # to it, the loser leaves before anything is read or changed), then the snapshot, the backend's apply
    # and the marks; whatever raises (a Ctrl-C at any line included) puts back the model and every mark
    journal = Journal()

    def begin() -> Snapshot:
        journal.open()
        claim(model)
        return chosen.snapshot(model, optimizer, plan)

    def bind() -> Amp:
        amp = chosen.apply(plan, model, optimizer, **options)
        amp.bind_also(model, amp.model)  # after what the backend bound itself (a wrapper's inner module)
        journal.close()
        return amp

    return all_or_nothing(begin, bind, journal.rollback)


def tuned_elsewhere(backend: Backend, policy: Policy, model: Any) -> None:
    """Warn when ``policy``'s speed decisions (``tuned_on``, from ``unimp tune``) were measured on another kind
    of device than the one ``model`` is on."""
    if not policy.tuned_on:
        return
    hooks = backend.tuning()
    here = hooks.device_kind(model) if hasattr(hooks, "device_kind") else None
    if here is not None and here != policy.tuned_on:
        warnings.warn(f"{policy.source}: tuned_on = {policy.tuned_on!r}, but the model is on {here!r}: the tuned "
                      f"policy's speed decisions (which layers run in FP8) were measured elsewhere; rerun unimp "
                      f"tune on this device for decisions that hold here", UnimpWarning, stacklevel=3)


def scope(policy: Any, *, backend: str = "keras") -> Any:
    """A context manager under which new models are built with ``policy`` (Keras: ``unimp.scope``).

    Only backends whose framework builds models under a global dtype policy offer it.
    """
    chosen = get_backend(backend)
    return chosen.scope(chosen.compile(load(policy)))


def remember(amp: Amp, *models: Any) -> None:
    """Mark more objects as bound to ``amp`` (e.g. a DDP wrapper made after ``apply``), so a second
    ``unimp.apply`` on them is refused; ``amp.remove()`` releases them."""
    amp.bind_also(*models)
