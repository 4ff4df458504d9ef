"""The resolved policy (``extends`` applied, every key validated) and what it asks of one layer.

>>> import unimp
>>> unimp.load("mixed_bf16").decide("fc", "linear").compute_dtype
'bfloat16'
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from unimp.dtypes import OUTPUT_DTYPES, is_low
from unimp.policy import resolve as resolving
from unimp.policy.resolve import to_text
from unimp.policy.spec import AUTO_INITIAL
from unimp.policy.tables import Distributed, Fp8Spec, Layout, LossScaleSpec, MasterWeights, OpLists, Override


@dataclass(frozen=True)
class LayerDecision:
    """What the policy asks of one layer: compute dtype (None = follow inputs) and param dtype; ``override``:
    the override that decided it, ``sets_compute``: that override sets the compute dtype (not only params)."""

    category: str
    compute_dtype: str | None
    param_dtype: str
    override: int | None = None
    sets_compute: bool = False


@dataclass(frozen=True)
class Policy:
    """A resolved policy (``extends`` applied). Build with :func:`unimp.load`."""

    name: str
    compute_dtype: str
    param_dtype: str
    output_dtype: str
    on_unsupported: str
    ops: OpLists
    loss_scale: LossScaleSpec
    master_weights: MasterWeights
    layout: Layout
    distributed: Distributed
    overrides: tuple[Override, ...] = ()
    fp8: Fp8Spec = Fp8Spec()
    tuned_on: str | None = None  # the device its speed decisions were measured on (unimp.tune); no fingerprint
    source: str = field(default="<dict>", compare=False)

    # ---------------------------------------------------------------- construction / export
    @classmethod
    def from_resolved(cls, d: Mapping[str, Any], source: str = "<dict>") -> Policy:
        """Build from a fully resolved, validated dict (see :func:`unimp.load`)."""
        ls = dict(d["loss_scale"])
        ls["hysteresis_refill"] = tuple(ls["hysteresis_refill"])
        if ls["initial"] == "auto":
            ls.update(initial=AUTO_INITIAL, initial_auto=True)
        return cls(
            name=d["name"], compute_dtype=d["compute_dtype"], param_dtype=d["param_dtype"],
            output_dtype=d["output_dtype"], on_unsupported=d["on_unsupported"],
            ops=OpLists(**{k: tuple(v) for k, v in d["ops"].items()}),
            loss_scale=LossScaleSpec(**ls), master_weights=MasterWeights(**d["master_weights"]),
            layout=Layout(**d["layout"]), distributed=Distributed(**d["distributed"]),
            overrides=tuple(Override(**_lists_as_tuples(o)) for o in d["overrides"]),
            fp8=Fp8Spec(**_lists_as_tuples(d["fp8"])),
            tuned_on=d.get("tuned_on"), source=source,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the resolved policy (loadable again; TOML/JSON/YAML-ready)."""
        def table(obj: Any) -> dict[str, Any]:
            return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(obj).items()}

        overrides = [{k: v for k, v in table(o).items() if v not in (None, [])} for o in self.overrides]
        loss_scale = table(self.loss_scale)
        if loss_scale.pop("initial_auto"):  # as a file writes it: the policy left the start to the framework
            loss_scale["initial"] = "auto"
        return {
            "name": self.name, "compute_dtype": self.compute_dtype, "param_dtype": self.param_dtype,
            "output_dtype": self.output_dtype, "on_unsupported": self.on_unsupported,
            "ops": table(self.ops), "loss_scale": loss_scale,
            "master_weights": table(self.master_weights), "layout": table(self.layout),
            "distributed": table(self.distributed), "overrides": overrides, "fp8": table(self.fp8),
            **({"tuned_on": self.tuned_on} if self.tuned_on is not None else {}),
        }

    @property
    def fingerprint(self) -> str:
        """Stable hash of everything that changes behaviour (not ``name``)."""
        d = self.to_dict()
        d.pop("name")
        d.pop("tuned_on", None)
        if self.fp8 == Fp8Spec():  # policies without FP8 keep the fingerprint they had before [fp8] existed
            d.pop("fp8")
        if d["loss_scale"]["backoff"] == "multiply":  # policies keep the fingerprint they had before the knob
            d["loss_scale"].pop("backoff")
        if d["loss_scale"]["initial"] == "auto":  # and the one they had when the default was 2^16 everywhere
            d["loss_scale"]["initial"] = AUTO_INITIAL
        text = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def loads_state_of(self, fingerprint: Any) -> bool:
        """Whether a state dict saved under ``fingerprint`` is this policy's: the same fingerprint, or one that
        differs only in ``output_dtype`` (casting the outputs changes no loss-scale state, so state dicts saved
        before a preset's outputs became ``"unchanged"`` keep loading strictly).

        >>> import unimp
        >>> p = unimp.load("mixed_fp16")
        >>> p.loads_state_of(p.replace(output_dtype="float32").fingerprint), p.loads_state_of("0" * 16)
        (True, False)
        """
        if fingerprint == self.fingerprint:
            return True
        if not isinstance(fingerprint, str):
            return False
        with warnings.catch_warnings():  # this policy was validated (and warned about) when loaded
            warnings.simplefilter("ignore")
            return any(self.replace(output_dtype=d).fingerprint == fingerprint
                       for d in OUTPUT_DTYPES if d != self.output_dtype)

    def replace(self, **changes: Any) -> Policy:
        """A new, re-validated policy; table keys merge (``loss_scale={"mode": "static"}``)."""
        source = f"{self.source} (replace)"
        return Policy.from_resolved(resolving.resolve(changes, parent=self.to_dict(), source=source), source)

    # ---------------------------------------------------------------- queries backends share
    @property
    def output_cast(self) -> str | None:
        """The dtype backends cast the model's floating outputs to; None for ``output_dtype = "unchanged"``
        (each output stays in the dtype its producing op ran in).

        >>> import unimp
        >>> unimp.load("fp32").output_cast, unimp.load("torch_autocast_cpu").output_cast
        ('float32', None)
        """
        return None if self.output_dtype == "unchanged" else self.output_dtype

    @property
    def low_precision_params(self) -> bool:
        return is_low(self.param_dtype)

    @property
    def uses_master_weights(self) -> bool:
        return self.master_weights.enabled and (
            is_low(self.param_dtype) or any(is_low(o.param_dtype) for o in self.overrides))

    def override_for(self, path: str, type_names: Iterable[str] = (), *,
                     sets: str = "dtype") -> tuple[int, Override] | None:
        """First override matching a module path or one of its type names (canonical or native)
        among those that set ``sets``: ``"dtype"`` (compute or param dtype) or ``"fp8"``."""
        names = tuple(type_names)
        for i, o in enumerate(self.overrides):
            if (o.sets_dtype if sets == "dtype" else o.fp8 is not None) and o.matches(path, names):
                return i, o
        return None

    def overrides_matching(self, path: str, type_names: Iterable[str] = ()) -> tuple[int, ...]:
        """Indices of every override that sets a dtype and matches a module path or one of its type names."""
        names = tuple(type_names)
        return tuple(i for i, o in enumerate(self.overrides) if o.sets_dtype and o.matches(path, names))

    def param_dtype_of(self, path: str, kind: str | None, type_names: Iterable[str] = ()) -> str:
        """The param dtype of one layer (it never depends on the compute dtype, so ``auto`` needs no
        resolving: for code that runs before any Plan exists, e.g. sharding a model)."""
        return self.decide(path, kind, type_names, "float32").param_dtype

    def decide(self, path: str, kind: str | None, type_names: Iterable[str] = (),
               compute_dtype: str | None = None) -> LayerDecision:
        """What this policy asks of one layer of canonical ``kind`` at ``path``.

        ``compute_dtype`` is the resolved compute dtype: backends use :meth:`unimp.Plan.decide`, which
        passes the Plan's. A decision that depends on an unresolved ``auto`` is refused (ValueError).
        """
        low = compute_dtype or self.compute_dtype
        category = self.ops.category(kind) if kind else "inputs"
        dtype = {"lower": low, "float32": "float32"}.get(category)
        param = "float32" if category == "float32" else self.param_dtype
        names = (*tuple(type_names), *((kind,) if kind else ()))
        hit = self.override_for(path, names)
        if hit is None:
            decision = LayerDecision(category, dtype, param)
        else:
            i, o = hit
            c = o.compute_dtype
            if c == "auto":
                c = low
            decision = LayerDecision("override", c or dtype, o.param_dtype or param, override=i,
                                     sets_compute=o.compute_dtype is not None)
        if decision.compute_dtype == "auto":
            raise ValueError(f"Policy.decide({path!r}): compute_dtype 'auto' is not resolved; pass the Plan's "
                             f"compute dtype (plan.decide(path, kind, type_names) does)")
        return decision

    def __str__(self) -> str:
        return to_text(self.to_dict(), "toml")


def _lists_as_tuples(table: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved table with its lists as tuples (the frozen dataclasses hold tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}
