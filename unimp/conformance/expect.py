"""Expected values, computed by the core from the policy alone (never by a backend).

>>> import unimp
>>> exp = expected_layers(unimp.load("mixed_bf16"), "bfloat16")
>>> exp["fc1"].compute_dtype, exp["norm"].compute_dtype, exp["act"].compute_dtype
('bfloat16', 'float32', 'bfloat16')
"""

from __future__ import annotations

from dataclasses import dataclass

from unimp.conformance.probe import PROBE
from unimp.dtypes import widest
from unimp.plan import Plan
from unimp.policy import Policy


@dataclass(frozen=True)
class Expect:
    compute_dtype: str
    param_dtype: str | None
    output_dtype: str


def expected_layers(policy: Policy, compute_dtype: str | None = None,
                    plan: Plan | None = None) -> dict[str, Expect]:
    """Per probe layer: the dtype it computes in, its params' dtype and its output dtype.

    Rules: ``lower`` -> compute dtype; ``float32`` -> float32; ``promote`` -> widest of the
    activation input and the params; in no list -> the activation input's dtype (for the
    embedding, whose input is integer, the param dtype). Overrides win. A fixed op the Plan
    reports as a fallback runs in the Plan's dtype; so do params (``plan.param_fallback``) and
    overrides (``plan.override_fallbacks``) a backend reports it cannot honour.
    """
    low = compute_dtype or (plan.compute_dtype if plan else policy.compute_dtype)
    out: dict[str, Expect] = {}
    x: str | None = None
    for layer in PROBE:
        d = policy.decide(layer.path, layer.kind, (), low)
        param = d.param_dtype if layer.params else None
        if plan is not None and param is not None and param != "float32" and plan.param_fallback:
            param = plan.param_fallback
        dtype = d.compute_dtype
        if d.override is None and d.category == "promote":
            dtype = widest([x, param])
        if plan is not None and d.override is None:
            op = plan.op(layer.kind)
            if not op.honoured:
                dtype = op.dtype
        if plan is not None and d.override is not None and d.override in plan.override_fallbacks:
            dtype = plan.override_fallbacks[d.override]
        if dtype is None:
            dtype = x if x is not None else param
        assert dtype is not None, layer.path  # the first probe layer has params, every later one an input
        out[layer.path] = Expect(dtype, param, dtype)
        x = dtype
    return out


def expected_output_dtype(policy: Policy, compute_dtype: str | None = None, plan: Plan | None = None) -> str:
    """The probe model's output dtype: ``output_dtype``, or for ``"unchanged"`` the dtype its last layer
    (``logp``) ran in by :func:`expected_layers` (nothing casts it, as under torch.autocast or Keras).

    >>> import unimp
    >>> pol = unimp.load("mixed_bf16")
    >>> expected_output_dtype(pol), expected_output_dtype(pol.replace(output_dtype="float16"))
    ('float32', 'float16')
    >>> expected_output_dtype(pol.replace(ops={"lower": ["linear", "log_softmax"], "float32": []}))
    'bfloat16'
    """
    if policy.output_cast is not None:
        return policy.output_cast
    return expected_layers(policy, compute_dtype, plan)[PROBE[-1].path].output_dtype
