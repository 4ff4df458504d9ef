"""The contract between the core and a backend: the request it receives (:class:`PlanRequest`) and the
Plan it returns (:class:`Plan`, built by :func:`compile_ops`).

The two name each other (``Plan.request(policy, backend)`` is the request, ``request.compile(...)`` its
Plan), so they share this module; their rows are :mod:`unimp.plan.tables`, the request's resolved
pieces :mod:`unimp.plan.request`, FP8 :mod:`unimp.plan.fp8`, the layout findings :mod:`unimp.plan.layout`.

>>> import unimp
>>> plan = compile_ops("demo", unimp.load("mixed_bf16"), control={"matmul": "op"}, native={},
...                    index=[LayerInfo("fc", "linear", ("Dense",), (("units", 12),))])
>>> plan.op("matmul").dtype, plan.op("softmax").control
('bfloat16', 'fixed')
>>> plan.decide("fc", "linear").compute_dtype, plan.layout.findings
('bfloat16', ('fc: units=12 is not a multiple of 8',))
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from unimp.dtypes import is_low
from unimp.errors import UnsupportedError
from unimp.loss_scale import loss_scale_as_run, loss_scale_fallbacks
from unimp.plan.fp8 import Fp8Decision, Fp8Plan, Fp8Support, asks_fp8, decide_fp8, plan_fp8, requests_fp8
from unimp.plan.layout import LayoutFindings
from unimp.plan.request import DtypeRequest, asked_loss_scale, override_dtypes, requested_dtype
from unimp.plan.tables import CONTROL_LEVELS, LayerInfo, LayerRow, OpDecision, compile_layers, compile_layout
from unimp.policy import LayerDecision, LossScaleSpec, MasterWeights, Policy
from unimp.policy.ops import CANONICAL_OPS
from unimp.policy.spec import AUTO_INITIAL
from unimp.report import format_table

AUTO_NOTE = '; initial "auto": where the framework\'s own scaler starts'


@dataclass(frozen=True)
class PlanRequest:
    """The request: the policy as asked of ``backend``, before the backend says what it can do.

    ``Backend.plan`` receives it (``Plan.request(policy, backend)``) and returns ``request.compile(...)``.
    ``compute_dtype`` is the policy's, maybe ``auto``, until the backend resolves it on its device and
    goes on with ``request.at(dtype)``, whose queries then answer at that dtype. The core resolves the
    overrides, once, for every backend: what one layer asks (:meth:`decide`), every dtype an override
    asks (:attr:`override_dtypes`, ``auto`` already the compute dtype) and the aggregates
    (:meth:`compute_requests`, :attr:`low_dtypes`, :attr:`mixes_compute`). ``policy`` is the core's: a
    backend reads these queries, never the policy or its override list.

    >>> import unimp
    >>> req = Plan.request(unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto",
    ...                                "overrides": [{"types": ["Linear"], "compute_dtype": "auto"},
    ...                                              {"modules": ["head"], "compute_dtype": "float32"}]}), "demo")
    >>> req.compute_dtype, req.at("float16").low_dtypes, req.at("float16").mixes_compute
    ('auto', ('float16',), True)
    >>> req.at("float16").compute_requests()
    (('compute_dtype', 'float16'), ('overrides[1].compute_dtype', 'float32'))
    >>> d = req.at("float16").decide("fc", "linear", ("Linear",))
    >>> d.compute_dtype, d.override, d.sets_compute
    ('float16', 0, True)
    """

    backend: str
    policy: Policy
    compute_dtype: str
    initial_scale: float = AUTO_INITIAL  # where the framework's own loss scaler starts: initial = "auto"

    @classmethod
    def of(cls, policy: Policy, backend: str) -> PlanRequest:
        return cls(backend, policy, policy.compute_dtype)

    def at(self, compute_dtype: str) -> PlanRequest:
        """This request with its compute dtype resolved (what the backend's device runs)."""
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def starting_at(self, initial_scale: float) -> PlanRequest:
        """This request on a framework whose own loss scaler starts at ``initial_scale``: where a policy's
        ``loss_scale.initial = "auto"`` starts (:meth:`unimp.policy.LossScaleSpec.starting_at`).

        >>> import unimp
        >>> Plan.request(unimp.load("mixed_fp16"), "demo").starting_at(32768.0).loss_scale.initial
        32768.0
        """
        return dataclasses.replace(self, initial_scale=initial_scale)

    def compile(self, **kwargs: Any) -> Plan:
        """The Plan of this request on its backend: :func:`unimp.plan.compile_ops` with what the backend
        can control (``compute_dtype`` defaults to this request's)."""
        kwargs.setdefault("compute_dtype", self.compute_dtype)
        kwargs.setdefault("initial_scale", self.initial_scale)
        return compile_ops(self.backend, self.policy, **kwargs)

    # ------------------------------------------------------------- the settings, as asked
    @property
    def where(self) -> str:
        """``policy 'name' (source)``: how messages name the policy."""
        return f"policy {self.policy.name!r} ({self.policy.source})"

    @property
    def on_unsupported(self) -> str:
        return self.policy.on_unsupported

    @property
    def param_dtype(self) -> str:
        """The dtype parameters are asked in (layers may override it: :meth:`decide`)."""
        return self.policy.param_dtype

    @property
    def low_precision_params(self) -> bool:
        return self.policy.low_precision_params

    @property
    def output_cast(self) -> str | None:
        """The dtype the model's floating outputs are cast to; None: left as the last op ran."""
        return self.policy.output_cast

    @property
    def master_weights(self) -> MasterWeights:
        return self.policy.master_weights

    @property
    def uses_master_weights(self) -> bool:
        """fp32 masters are kept for some low-precision parameter."""
        return self.policy.uses_master_weights

    @property
    def reduce_dtype(self) -> str:
        return self.policy.distributed.reduce_dtype

    @property
    def fp8_requested(self) -> bool:
        """The policy asks FP8 somewhere (the table or an override)."""
        return requests_fp8(self.policy)

    @property
    def loss_scale(self) -> LossScaleSpec:
        """The loss-scale spec asked at this compute dtype (:func:`asked_loss_scale`); the Plan's
        ``loss_scale`` is what runs (this, with the knobs the backend cannot honour replaced)."""
        return asked_loss_scale(self.policy, self.compute_dtype).starting_at(self.initial_scale, self.backend)

    # ------------------------------------------------------------- ops and layers, resolved
    @property
    def ops(self) -> tuple[OpDecision, ...]:
        """Every canonical op as requested: its category and the dtype asked at this compute dtype."""
        return tuple(OpDecision(op, self.policy.ops.category(op), self.requested(op), "op") for op in CANONICAL_OPS)

    def op(self, name: str) -> OpDecision:
        for d in self.ops:
            if d.op == name:
                return d
        raise KeyError(name)

    def requested(self, op: str, compute_dtype: str | None = None) -> str | None:
        """The dtype asked for ``op`` (None = follow inputs), at ``compute_dtype`` (default: this request's)."""
        return requested_dtype(self.policy, op, compute_dtype or self.compute_dtype)

    def decide(self, path: str, kind: str | None, type_names: Iterable[str] = ()) -> LayerDecision:
        """What one layer asks at this (resolved) compute dtype: its compute and param dtypes and the
        override that set them (the first that matches). The Plan answers the same from its table."""
        return self.policy.decide(path, kind, tuple(type_names), self.compute_dtype)

    def param_dtype_of(self, path: str, kind: str | None, type_names: Iterable[str] = ()) -> str:
        """The param dtype of one layer (independent of the compute dtype: usable before it is resolved)."""
        return self.policy.param_dtype_of(path, kind, type_names)

    @property
    def override_dtypes(self) -> tuple[DtypeRequest, ...]:
        """Every dtype an override asks, in override order (compute before param), ``auto`` resolved to
        this request's compute dtype (:func:`unimp.plan.request.override_dtypes`)."""
        return override_dtypes(self.policy, self.compute_dtype)

    def compute_requests(self) -> tuple[tuple[str, str], ...]:
        """``(setting, dtype)`` of every compute dtype asked explicitly: ``compute_dtype`` first, then each
        override naming one (an ``auto`` override asks the compute dtype: nothing more)."""
        return (("compute_dtype", self.compute_dtype), *((r.setting, r.dtype) for r in self.override_dtypes
                                                         if r.key == "compute_dtype" and not r.follows_compute))

    @property
    def low_dtypes(self) -> tuple[str, ...]:
        """The low-precision dtypes some layer computes in (the compute dtype and the overrides'), sorted."""
        return tuple(sorted({d for _, d in self.compute_requests() if is_low(d)}))

    @property
    def mixes_compute(self) -> bool:
        """Some override computes in another dtype than the compute dtype (the ops after it meet mixed inputs)."""
        return any(d != self.compute_dtype for _, d in self.compute_requests()[1:])


@dataclass(frozen=True)
class Plan:
    """What one backend will do with one policy: the only thing a backend reads.

    Every field is resolved: the compute dtype (never ``auto``) and why, the per-op table, the
    per-layer decision table (overrides resolved once by the core: :meth:`decide`), ``loss_scale``
    (the spec that runs: ``auto`` resolved, the knobs the backend cannot honour replaced, named in the
    notes), the settings backends act on (``param_dtype``, ``output_cast``, ``master_weights``,
    ``reduce_dtype``, ``channels_last``, ...), the FP8 part and the layout findings. ``details``: the
    backend's own frozen dataclass of what it decided at compile time (e.g. the torch backend's
    autocast dtype and op moves), read back by attribute, never by string key.

    ``Backend.plan`` receives the *request* (:class:`PlanRequest`, ``Plan.request(policy, backend)``:
    the policy as asked, ``compute_dtype`` maybe ``"auto"``) and returns ``request.compile(...)`` with
    what it can control. ``policy`` is the core's (reports, ``amp.policy``): a backend never reads it.

    >>> import unimp
    >>> req = Plan.request(unimp.load("mixed_fp16"), "demo")
    >>> req.compute_dtype, req.param_dtype, req.output_cast, req.uses_master_weights, req.reduce_dtype
    ('float16', 'float32', None, False, 'float32')
    >>> plan = req.compile(control={"matmul": "op"}, native={})
    >>> plan.op("matmul").dtype, plan.loss_scale.mode
    ('float16', 'dynamic')
    """

    Request = PlanRequest  # the request's type, also as ``Plan.Request``

    backend: str
    policy: Policy  # the core's: backends read the fields below
    compute_dtype: str
    compute_reason: str
    ops: tuple[OpDecision, ...]
    loss_scale: LossScaleSpec  # the spec that runs
    name: str
    fingerprint: str
    where: str  # ``policy 'name' (source)``: how messages name the policy
    on_unsupported: str
    param_dtype: str  # the dtype parameters are asked in (layers may override it: decide())
    output_cast: str | None  # the dtype floating outputs are cast to; None: left as the last op ran
    master_weights: MasterWeights
    uses_master_weights: bool  # fp32 masters are kept for some low-precision parameter
    reduce_dtype: str
    channels_last: bool
    notes: tuple[str, ...] = ()
    details: Any = None
    param_fallback: str | None = None  # dtype low-precision params really hold, when the backend cannot lower them
    override_fallbacks: Mapping[int, str] = field(default_factory=dict)  # override index -> dtype that runs
    layers: tuple[LayerRow, ...] = ()  # the per-layer decision table (when compiled with a model index)
    layout: LayoutFindings = field(default=LayoutFindings(0, "ignore"))
    fp8: Fp8Plan | None = None  # the [fp8] part (unimp.plan.fp8); None = built without FP8 support declared

    @staticmethod
    def request(policy: Policy, backend: str) -> PlanRequest:
        """The policy as asked, before ``backend`` says what it can do: what ``Backend.plan`` receives."""
        return PlanRequest.of(policy, backend)

    @property
    def low_precision_params(self) -> bool:
        return is_low(self.param_dtype)

    @property
    def loss_scale_run(self) -> LossScaleSpec:
        """Deprecated: :attr:`loss_scale` is the spec that runs."""
        warnings.warn("Plan.loss_scale_run is deprecated: plan.loss_scale is the loss-scale spec that runs",
                      DeprecationWarning, stacklevel=2)
        return self.loss_scale

    def decide_fp8(self, path: str, kind: str | None, type_names: Iterable[str] = (),
                   dims: Mapping[str, int] | None = None) -> Fp8Decision:
        """FP8 or not for one layer on this backend (:func:`unimp.plan.fp8.decide_fp8`)."""
        return decide_fp8(self, path, kind, type_names, dims, self.compute_dtype)

    def asks_fp8(self, path: str, kind: str | None, type_names: Iterable[str] = ()) -> bool:
        """Whether the policy asks FP8 of this layer at all (its decision is then reported)."""
        return asks_fp8(self, path, kind, type_names)

    def op(self, name: str) -> OpDecision:
        for d in self.ops:
            if d.op == name:
                return d
        raise KeyError(name)

    def decide(self, path: str, kind: str | None, type_names: tuple[str, ...] = ()) -> LayerDecision:
        """What one layer asks (the core's one per-layer query): its compute and param dtypes, resolved,
        and the override that set them. The table's row when the Plan indexed it, else the policy's
        decision at the Plan's compute dtype (for layers a backend meets at run time)."""
        names = tuple(type_names)
        row = self._rows.get(path)
        if row is not None and row.kind == kind and (not names or row.type_names == names):
            return row.decision
        return self.policy.decide(path, kind, names, self.compute_dtype)

    @functools.cached_property
    def _rows(self) -> dict[str, LayerRow]:
        return {r.path: r for r in self.layers}

    def with_index(self, index: Iterable[LayerInfo]) -> Plan:
        """This Plan with the decision table and layout findings of a model's index (a backend binding a
        Plan compiled without the model calls this once, with the model it binds)."""
        index = tuple(index)
        return dataclasses.replace(self, layers=compile_layers(self.policy, self.compute_dtype, index),
                                   layout=compile_layout(self.policy, index))

    def layer(self, path: str) -> LayerRow:
        """The decision-table row of ``path`` (KeyError when the Plan did not index it)."""
        return self._rows[path]

    @property
    def ambiguities(self) -> tuple[str, ...]:
        """One line per layer matched by overrides that disagree (the first one wins)."""
        return tuple(f"layer {r.path or '<model>'}: overrides {', '.join(f'#{i}' for i in r.ambiguous)} all "
                     f"match and disagree; override #{r.ambiguous[0]} wins (make the globs/types disjoint)"
                     for r in self.layers if r.ambiguous)

    @property
    def _asked_loss_scale(self) -> LossScaleSpec:
        """The spec as asked, ``auto`` resolved (the compute dtype, and an ``auto`` initial scale to where
        this backend's framework starts): what the report shows (what differs in :attr:`loss_scale` is in the
        notes)."""
        return asked_loss_scale(self.policy, self.compute_dtype).starting_at(self.loss_scale.initial)

    @property
    def fallbacks(self) -> tuple[OpDecision, ...]:
        return tuple(d for d in self.ops if not d.honoured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "policy": self.policy.name, "fingerprint": self.policy.fingerprint,
            "compute_dtype": self.compute_dtype, "compute_reason": self.compute_reason,
            "ops": [{"op": d.op, "requested": d.requested, "dtype": d.dtype, "control": d.control,
                     "honoured": d.honoured, "native": list(d.native), "note": d.note} for d in self.ops],
            "notes": list(self.notes), "details": _details(self.details),
            "param_fallback": self.param_fallback,
            "override_fallbacks": {str(k): v for k, v in self.override_fallbacks.items()},
            "fp8": self.fp8.to_dict() if self.fp8 is not None else None,
            "loss_scale": _plain({k: v for k, v in vars(self._asked_loss_scale).items() if k != "initial_auto"}),
            "layers": [{"path": r.path, "kind": r.kind, "compute_dtype": r.decision.compute_dtype,
                        "param_dtype": r.decision.param_dtype, "override": r.decision.override,
                        "ambiguous": list(r.ambiguous)} for r in self.layers],
            "layout": {"align": self.layout.align, "action": self.layout.action,
                       "findings": list(self.layout.findings)},
        }

    def __str__(self) -> str:
        asked = self._asked_loss_scale
        head = (f"Plan: policy {self.policy.name!r} ({self.policy.fingerprint}) on backend {self.backend}\n"
                f"compute dtype: {self.compute_dtype} ({self.compute_reason})\n"
                f"loss scale: {describe_loss_scale(asked)}"
                f"{'' if asked.mode == self.policy.loss_scale.mode else ' (auto resolved to float16 needs it)'}"
                f"{AUTO_NOTE if self.policy.loss_scale.initial_auto else ''}\n")
        rows = []
        for d in self.ops:
            native = ", ".join(d.native[:4]) + (" ..." if len(d.native) > 4 else "")
            runs = d.runs_in + ("" if d.honoured else " (fallback)")
            rows.append((d.op, d.requested, runs, d.control, native))
        notes = ([f"note: {n}" for n in self.notes] + [f"fallback: {d.op}: {d.note}" for d in self.fallbacks]
                 + [f"ambiguous: {a}" for a in self.ambiguities])
        notes += self.fp8.describe() if self.fp8 is not None else []
        return head + format_table(("op", "policy", "runs in", "control", "native"), rows, footer=notes)


def _details(d: Any) -> Any:
    return _plain(d) if d is not None else {}


def _plain(v: Any) -> Any:
    """``v`` as JSON data: a dataclass (a backend's details, or one of their fields) as a dict of its fields."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple | set | frozenset):
        return [_plain(x) for x in (sorted(v) if isinstance(v, set | frozenset) else v)]
    return v if isinstance(v, str | int | float | bool | type(None)) else repr(v)


def describe_loss_scale(s: LossScaleSpec) -> str:
    """The loss-scale rule in one line, every knob the replay depends on included.

    >>> import unimp
    >>> describe_loss_scale(unimp.load("deepspeed_fp16").loss_scale)  # doctest: +ELLIPSIS
    'dynamic from 65536 (x2 after 1000 finite steps, x0.5 on overflow, hysteresis 1, ...held in float64...'
    """
    skip = ", skips non-finite steps" if s.skip_nonfinite else ""
    if s.mode == "none":
        return f"none{skip}"
    if s.mode == "static":
        return f"static {s.initial:g}{skip}"
    return (f"dynamic from {s.initial:g} (x{s.growth_factor:g} after {s.growth_interval} finite steps, "
            + (f"/{s.growth_factor:g} on overflow" if s.backoff == "divide" else f"x{s.backoff_factor:g} on overflow")
            + f", hysteresis {s.hysteresis}, min {s.min:g} (at min: {s.at_min}), "
            f"max {s.max:g} (on max: {s.on_max}); held in {s.scale_dtype}, subnormals {s.subnormal}, "
            f"factors in {s.factor_arithmetic}){skip}")


def compile_ops(backend: str, policy: Policy, *, control: Mapping[str, str],
                native: Mapping[str, tuple[str, ...]], compute_dtype: str | None = None,
                compute_reason: str = "as the policy says",
                fixed: Mapping[str, tuple[str | None, str]] | None = None,
                notes: tuple[str, ...] = (), details: Any = None, index: Iterable[LayerInfo] | None = None,
                param_fallback: str | None = None,
                override_fallbacks: Mapping[int, str] | None = None,
                fp8: Fp8Support | None = None, problems: Sequence[str] = (),
                fix: str = "change the policy's op lists",
                loss_scale_unsupported: Mapping[str, tuple[object, str]] | None = None,
                initial_scale: float = AUTO_INITIAL) -> Plan:
    """Build a Plan, applying the policy's ``on_unsupported`` to what the backend cannot honour.

    ``control[op]`` is ``op`` or ``layer`` for ops the backend controls (missing = ``fixed``);
    ``fixed[op] = (dtype the framework uses or None for inputs, why)`` for ops it does not.
    A fixed op whose framework dtype differs from the request is an :class:`UnsupportedError`
    (``on_unsupported = "error"``) or a reported fallback. ``index`` (the model's layers) fills the
    per-layer decision table and the layout findings. ``fp8``: what the backend can run in FP8
    (None: nothing); the policy's ``[fp8]`` request is checked against it the same way
    (:func:`unimp.plan.fp8.plan_fp8`). ``problems``: what else the backend cannot honour (parameters,
    overrides, loss scaling), refused with the ops' problems or noted as fallbacks; ``fix``: the
    first half of the error's fix line. ``loss_scale_unsupported``: ``{knob: (what runs instead, why)}``
    for the loss-scale knobs the backend cannot honour (:func:`loss_scale_fallbacks`): refused, or noted
    and run as :attr:`Plan.loss_scale`; ``initial_scale``: where the framework's own scaler starts, what
    ``loss_scale.initial = "auto"`` resolves to.
    """
    low = compute_dtype or policy.compute_dtype
    where = f"policy {policy.name!r} ({policy.source})"
    loss_scale, scale_notes = asked_loss_scale(policy, low).starting_at(initial_scale, backend), []
    if loss_scale_unsupported:  # refused first: the rule the training step runs
        scale_notes = loss_scale_fallbacks(loss_scale, loss_scale_unsupported, where, policy.on_unsupported)
        loss_scale = loss_scale_as_run(loss_scale, loss_scale_unsupported)
    fixed = fixed or {}
    decisions, unmet = [], []
    for op in CANONICAL_OPS:
        want = requested_dtype(policy, op, low)
        level = control.get(op, "fixed")
        if level not in CONTROL_LEVELS:
            raise ValueError(f"control level {level!r} for {op} is not one of {CONTROL_LEVELS}")
        nat = tuple(native.get(op, ()))
        if level != "fixed":
            decisions.append(OpDecision(op, policy.ops.category(op), want, level, nat))
            continue
        actual, why = fixed.get(op, (want, "the framework decides; it matches the request"))
        if actual == want:
            decisions.append(OpDecision(op, policy.ops.category(op), want, "fixed", nat, True, why))
            continue
        unmet.append(f"{op}: policy asks {want or 'input dtype'}, {backend} runs it in "
                     f"{actual or 'its input dtype'} ({why})")
        decisions.append(OpDecision(op, policy.ops.category(op), actual, "fixed", nat, False, why))
    if (unmet or problems) and policy.on_unsupported == "error":
        raise UnsupportedError(
            f"{where} cannot be honoured by backend {backend}:\n  "
            + "\n  ".join([*unmet, *problems])
            + f"\nfix: {fix}, or set on_unsupported = \"fallback\" to run these as reported in the Plan")
    notes = (*notes, *(f"fallback: {p}" for p in problems), *scale_notes)
    rows = compile_layers(policy, low, index or ())
    return Plan(backend, policy, low, compute_reason, tuple(decisions), loss_scale, policy.name, policy.fingerprint,
                where, policy.on_unsupported, policy.param_dtype, policy.output_cast, policy.master_weights,
                policy.uses_master_weights, policy.distributed.reduce_dtype, policy.layout.channels_last,
                tuple(notes), details, param_fallback, dict(override_fallbacks or {}), rows,
                compile_layout(policy, index or ()), plan_fp8(policy, backend, fp8))
