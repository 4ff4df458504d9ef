"""The policy file format as one declarative table: defaults, checks and the JSON Schema.

Every key a policy file may hold is a :class:`Field` here; the validator and ``unimp schema``
both read this table, so the two can never disagree.

>>> DEFAULTS["loss_scale"]["growth_interval"]
2000
>>> json_schema()["properties"]["compute_dtype"]["enum"]
['float16', 'bfloat16', 'float32', 'auto']
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .dtypes import COMPUTE_DTYPES, FLOAT_DTYPES
from .ops import CANONICAL_OPS, OP_LISTS, suggest

GROWTH_SCHEDULES = ("interval", "interval_plus_one", "window")
HYSTERESIS_EVENTS = ("finite", "growth", "backoff")
FLT_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Field:
    """One key of the file format."""

    kind: str  # str | bool | int | float | enum | oplist | strlist | enumlist
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    allow_inf: bool = False


def _enum(choices: tuple[str, ...], default: str, doc: str) -> Field:
    return Field("enum", default, doc, choices=choices)


TOP: dict[str, Field] = {
    "name": Field("str", "custom", "a name for people; not part of the fingerprint"),
    "extends": Field("str", None, "a preset name or a path relative to this file"),
    "compute_dtype": _enum(COMPUTE_DTYPES, "bfloat16", "dtype of ops in the `lower` list"),
    "param_dtype": _enum(FLOAT_DTYPES, "float32", "dtype parameters hold in forward"),
    "output_dtype": _enum(FLOAT_DTYPES, "float32", "dtype of the model's outputs"),
    "on_unsupported": _enum(("error", "fallback"), "error",
                            "what to do when a backend cannot honour a request"),
}

TABLES: dict[str, dict[str, Field]] = {
    "ops": {
        "lower": Field("oplist", ["matmul", "linear", "conv", "attention", "rnn"],
                       "canonical ops run in compute_dtype"),
        "float32": Field("oplist", ["softmax", "log_softmax", "layer_norm", "batch_norm", "group_norm",
                                    "rms_norm", "loss", "reduction", "transcendental"],
                         "canonical ops always run in float32"),
        "promote": Field("oplist", ["elementwise", "concat"], "canonical ops run in the widest input dtype"),
    },
    "loss_scale": {
        "mode": _enum(("none", "static", "dynamic"), "dynamic", "loss scaling mode"),
        "initial": Field("float", 65536.0, "initial (or static) scale", exclusive_minimum=0.0),
        "growth_factor": Field("float", 2.0, "scale multiplier on growth", exclusive_minimum=1.0),
        "backoff_factor": Field("float", 0.5, "scale multiplier on backoff",
                                exclusive_minimum=0.0, exclusive_maximum=1.0),
        "growth_interval": Field("int", 2000, "finite steps between growths", minimum=1),
        "hysteresis": Field("int", 1, "non-finite steps absorbed before a backoff", minimum=1),
        "min": Field("float", 1.0, "floor of the scale (0 = none)", minimum=0.0),
        "max": Field("float", 16777216.0, "cap of the scale (inf = none)", exclusive_minimum=0.0,
                     allow_inf=True),
        "skip_nonfinite": Field("bool", True, "skip optimizer steps whose gradients are not finite"),
        "growth_schedule": _enum(GROWTH_SCHEDULES, "interval",
                                 "interval: grow on the N-th consecutive finite step (torch, Keras, jmp, "
                                 "Paddle); interval_plus_one: on the (N+1)-th (Flax); window: DeepSpeed"),
        "on_max": _enum(("keep", "clamp"), "keep",
                        "a grown scale above max: keep the old scale (torch) or clamp to max (Flax)"),
        "growth_requires_finite": Field("bool", True,
                                        "a grown scale is kept only if finite (false: Keras 3)"),
        "hysteresis_refill": Field("enumlist", ["finite"],
                                   "events that refill hysteresis: finite step, growth, backoff",
                                   choices=HYSTERESIS_EVENTS),
        "at_min": _enum(("clamp", "error"), "clamp",
                        "a backoff needed at the floor: stay there, or raise (DeepSpeed)"),
    },
    "master_weights": {
        "enabled": Field("bool", True, "keep float32 masters when params are lower precision"),
        "dtype": _enum(("float32",), "float32", "dtype of master weights"),
    },
    "layout": {
        "channels_last": Field("bool", True, "NHWC for convolution nets"),
        "align": Field("int", 8, "dims that should be multiples of this", minimum=1),
        "on_misaligned": _enum(("ignore", "warn", "error"), "warn", "what to do with misaligned dims"),
    },
    "distributed": {
        "reduce_dtype": _enum(FLOAT_DTYPES, "float32", "dtype of the gradient all-reduce"),
    },
}

OVERRIDE: dict[str, Field] = {
    "modules": Field("strlist", [], "fnmatch globs on dotted module paths"),
    "types": Field("strlist", [], "canonical op names or native layer class names"),
    "compute_dtype": _enum(COMPUTE_DTYPES, None, "compute dtype of matched modules"),
    "param_dtype": _enum(FLOAT_DTYPES, None, "parameter dtype of matched modules"),
}

DEFAULTS: dict[str, Any] = {
    **{k: f.default for k, f in TOP.items() if k != "extends"},
    **{t: {k: f.default for k, f in fields.items()} for t, fields in TABLES.items()},
    "overrides": [],
}


# ---------------------------------------------------------------- validation of one file's layer


class Problems:
    """Collects located problems (capped so hostile input stays fast)."""

    LIMIT = 20

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        if len(self.items) < self.LIMIT:
            self.items.append(f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}")


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _unknown_key(key: Any, known: list[str], path: str, problems: Problems) -> None:
    hint = suggest(key, known) if isinstance(key, str) else None
    fix = f"did you mean '{hint}'?" if hint else f"valid keys: {', '.join(known)}"
    problems.add(path, f"unknown key {key!r} ({fix})")


def check_value(field: Field, value: Any, path: str, problems: Problems) -> Any:
    """Check one value against its field; returns the normalised value (or None when bad)."""
    kind = field.kind
    if kind == "str":
        if not isinstance(value, str) or not value.strip():
            problems.add(path, f"expected a non-empty string, got {_type_name(value)}")
            return None
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            problems.add(path, f"expected true or false, got {_type_name(value)} {value!r:.40}")
            return None
        return value
    if kind == "enum":
        if value is None and field.default is None:
            return None
        if not isinstance(value, str) or value not in field.choices:
            hint = suggest(value, field.choices) if isinstance(value, str) else None
            tail = f" (did you mean '{hint}'?)" if hint else ""
            problems.add(path, f"{value!r:.40} is not one of {', '.join(field.choices)}{tail}")
            return None
        return value
    if kind in ("int", "float"):
        return _check_number(field, value, path, problems)
    if kind in ("oplist", "strlist", "enumlist"):
        return _check_list(field, value, path, problems)
    raise AssertionError(kind)


def _check_number(field: Field, value: Any, path: str, problems: Problems) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.add(path, f"expected {'an integer' if field.kind == 'int' else 'a number'}, "
                           f"got {_type_name(value)} {value!r:.40}")
        return None
    if field.kind == "int" and not isinstance(value, int):
        problems.add(path, f"expected an integer, got {value!r}")
        return None
    if isinstance(value, float) and math.isnan(value):
        problems.add(path, "NaN is not allowed")
        return None
    if isinstance(value, float) and math.isinf(value) and not (field.allow_inf and value > 0):
        problems.add(path, "must be finite")
        return None
    bounds = [(field.minimum, lambda v, b: v >= b, ">="), (field.exclusive_minimum, lambda v, b: v > b, ">"),
              (field.exclusive_maximum, lambda v, b: v < b, "<")]
    for bound, ok, word in bounds:
        if bound is not None and not ok(value, bound):
            problems.add(path, f"must be {word} {bound:g}, got {value!r}")
            return None
    return float(value) if field.kind == "float" else value


def _check_list(field: Field, value: Any, path: str, problems: Problems) -> Any:
    if not isinstance(value, list):
        problems.add(path, f"expected a list, got {_type_name(value)}")
        return None
    out: list[str] = []
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, str) or not item:
            problems.add(where, f"expected a non-empty string, got {_type_name(item)}")
            continue
        if field.kind == "oplist" and item not in CANONICAL_OPS:
            hint = suggest(item, CANONICAL_OPS)
            tail = f"did you mean '{hint}'?" if hint else "`unimp ops` lists the canonical ops"
            problems.add(where, f"unknown op {item!r} ({tail})")
            continue
        if field.kind == "enumlist" and item not in field.choices:
            problems.add(where, f"{item!r} is not one of {', '.join(field.choices)}")
            continue
        if item in out:
            problems.add(where, f"{item!r} is listed twice")
            continue
        out.append(item)
    return out


def check_layer(raw: Any, problems: Problems) -> dict[str, Any]:
    """Validate one file's own content (before `extends` is applied); returns it normalised."""
    if not isinstance(raw, dict):
        problems.add("", f"a policy must be a table of keys, got {_type_name(raw)}")
        return {}
    known = [*TOP, *TABLES, "overrides"]
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key in TOP:
            checked = check_value(TOP[key], value, key, problems)
            if checked is not None:
                out[key] = checked
        elif key in TABLES:
            out[key] = _check_table(TABLES[key], value, key, problems)
        elif key == "overrides":
            out[key] = _check_overrides(value, problems)
        else:
            _unknown_key(key, known, "", problems)
    ops = out.get("ops", {})
    seen: dict[str, str] = {}
    for lst in OP_LISTS:
        for i, op in enumerate(ops.get(lst, [])):
            if op in seen:
                problems.add(f"ops.{lst}[{i}]", f"{op!r} is already in ops.{seen[op]}; an op belongs "
                                                f"to one list (remove it from one of them)")
            seen[op] = lst
    return out


def _check_table(fields: dict[str, Field], value: Any, path: str, problems: Problems) -> dict[str, Any]:
    if not isinstance(value, dict):
        problems.add(path, f"expected a table, got {_type_name(value)}")
        return {}
    out = {}
    for key, item in value.items():
        if key not in fields:
            _unknown_key(key, list(fields), path, problems)
            continue
        checked = check_value(fields[key], item, f"{path}.{key}", problems)
        if checked is not None:
            out[key] = checked
    return out


def _check_overrides(value: Any, problems: Problems) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        problems.add("overrides", f"expected a list of tables ([[overrides]]), got {_type_name(value)}")
        return []
    out = []
    for i, item in enumerate(value):
        path = f"overrides[{i}]"
        table = _check_table(OVERRIDE, item, path, problems)
        if not isinstance(item, dict):
            continue
        if not table.get("modules") and not table.get("types"):
            problems.add(path, "matches nothing: give `modules` (globs on module paths) and/or `types`")
        if table.get("compute_dtype") is None and table.get("param_dtype") is None:
            problems.add(path, "changes nothing: give compute_dtype and/or param_dtype")
        for j, t in enumerate(table.get("types", [])):
            if t[0].islower() and t not in CANONICAL_OPS:
                hint = suggest(t, CANONICAL_OPS)
                tail = f" (did you mean '{hint}'?)" if hint else ""
                problems.add(f"{path}.types[{j}]", f"{t!r} is neither a canonical op nor a native class "
                                                   f"name (class names start upper-case){tail}")
        for j, g in enumerate(table.get("modules", [])):
            if not g.strip():
                problems.add(f"{path}.modules[{j}]", "an empty glob matches nothing")
        out.append(table)
    return out


def check_resolved(policy: dict[str, Any], problems: Problems) -> None:
    """Checks that span several keys, run on the fully resolved policy."""
    ls = policy["loss_scale"]
    if ls["min"] > ls["initial"]:
        problems.add("loss_scale.min", f"min ({ls['min']:g}) is above initial ({ls['initial']:g})")
    if ls["mode"] == "dynamic" and not ls["skip_nonfinite"]:
        import warnings

        from .errors import UnimpWarning

        warnings.warn(f"{problems.source}: loss_scale.skip_nonfinite: false with mode = 'dynamic' applies the "
                      f"non-finite steps that make the scale back off (parameters become NaN); set "
                      f"skip_nonfinite = true unless that is what you want", UnimpWarning, stacklevel=2)
    if ls["initial"] > ls["max"]:
        problems.add("loss_scale.initial", f"initial ({ls['initial']:g}) is above max ({ls['max']:g})")


# ---------------------------------------------------------------- JSON Schema


def _field_schema(field: Field) -> dict[str, Any]:
    k = field.kind
    if k == "str":
        return {"type": "string", "minLength": 1, "description": field.doc}
    if k == "bool":
        return {"type": "boolean", "description": field.doc}
    if k == "enum":
        return {"enum": list(field.choices), "description": field.doc}
    if k in ("int", "float"):
        s: dict[str, Any] = {"type": "integer" if k == "int" else "number", "description": field.doc}
        if field.minimum is not None:
            s["minimum"] = field.minimum
        if field.exclusive_minimum is not None:
            s["exclusiveMinimum"] = field.exclusive_minimum
        if field.exclusive_maximum is not None:
            s["exclusiveMaximum"] = field.exclusive_maximum
        return s
    items = {"oplist": {"enum": list(CANONICAL_OPS)}, "enumlist": {"enum": list(field.choices)},
             "strlist": {"type": "string", "minLength": 1}}[k]
    return {"type": "array", "items": items, "uniqueItems": True, "description": field.doc}


def _object(fields: dict[str, Field]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "properties": {k: _field_schema(f) for k, f in fields.items()}}


def json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of one policy file."""
    override = _object(OVERRIDE)
    override["anyOf"] = [{"required": ["modules"]}, {"required": ["types"]}]
    props = {k: _field_schema(f) for k, f in TOP.items()}
    props.update({t: _object(f) for t, f in TABLES.items()})
    props["overrides"] = {"type": "array", "items": override}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "unimp policy",
            "type": "object", "additionalProperties": False, "properties": props}
