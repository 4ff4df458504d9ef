"""The policy file format as one declarative table: defaults, checks and the JSON Schema.

Every key a policy file may hold is a :class:`Field` here; the validator and ``unimp schema``
both read this table, so the two can never disagree.

>>> DEFAULTS["loss_scale"]["growth_interval"]
2000
>>> json_schema()["properties"]["compute_dtype"]["enum"]
['float16', 'bfloat16', 'float32', 'auto']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unimp.dtypes import COMPUTE_DTYPES, FLOAT_DTYPES, FLT_MAX, FLT_TINY, INT32_MAX, OUTPUT_DTYPES
from unimp.policy.ops import CANONICAL_OPS, OP_LISTS, suggest

GROWTH_SCHEDULES = ("interval", "interval_plus_one", "window")
FP8_OPS = ("linear", "matmul", "attention")  # canonical ops an FP8 recipe can cover (a backend declares which)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_gw_hp", "delayed")
MAX_AMAX_HISTORY = 1 << 16  # entries of a delayed-scaling amax history (Transformer Engine uses 1024)
HYSTERESIS_EVENTS = ("finite", "growth", "backoff")
FLT_TRUE_MIN = 2.0 ** -149  # smallest subnormal float32: every system's scale accepts down to it (IEEE)
MAX_NAME = 256  # characters of a name, a glob or a type name
MAX_PATH = 1024  # characters of an `extends` value
MAX_ITEMS = 256  # globs/types per override, and overrides per policy: bounds the work of matching
AUTO_INITIAL = 65536.0  # loss_scale.initial = "auto" on a backend that declares no other: torch's GradScaler,
# Flax's DynamicScale and Paddle's GradScaler start at 2^16 (Keras' LossScaleOptimizer at 2^15: its backend says so)


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
    maximum: float | None = None
    allow_inf: bool = False  # +inf allowed (written ``inf``; the string "inf" in JSON)
    allow_auto: bool = False  # the string "auto" allowed: the backend's framework decides
    max_len: int = MAX_NAME  # characters of a string / of each list item
    max_items: int = MAX_ITEMS  # items of a list


def _enum(choices: tuple[str, ...], default: str | None, doc: str) -> Field:
    return Field("enum", default, doc, choices=choices)


TOP: dict[str, Field] = {
    "name": Field("str", "custom", "a name for people; not part of the fingerprint"),
    "extends": Field("str", None, "a preset name or a path inside this file's directory tree",
                     max_len=MAX_PATH),
    "compute_dtype": _enum(COMPUTE_DTYPES, "bfloat16", "dtype of ops in the `lower` list"),
    "param_dtype": _enum(FLOAT_DTYPES, "float32", "dtype parameters hold in forward"),
    "output_dtype": _enum(OUTPUT_DTYPES, "float32",
                          "dtype the model's floating outputs are cast to; \"unchanged\": not cast, each output "
                          "in the dtype its producing op ran in (torch.autocast, Keras 3, Paddle auto_cast)"),
    "on_unsupported": _enum(("error", "fallback"), "error",
                            "what to do when a backend cannot honour a request"),
    "tuned_on": Field("str", None, "the device a tuned policy's speed decisions were measured on (`unimp tune` "
                                   "writes it); applying it on another kind of device warns; not part of the "
                                   "fingerprint"),
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
        "initial": Field("float", "auto", "initial (or static) scale; \"auto\": where the framework's own scaler "
                                          "starts (2^16: torch GradScaler, Flax DynamicScale, Paddle GradScaler; "
                                          "2^15: Keras LossScaleOptimizer)", exclusive_minimum=0.0,
                         minimum=FLT_TRUE_MIN, maximum=FLT_MAX, allow_auto=True),
        "growth_factor": Field("float", 2.0, "scale multiplier on growth", exclusive_minimum=1.0,
                               maximum=FLT_MAX),
        "backoff_factor": Field("float", 0.5, "scale multiplier on backoff",
                                exclusive_minimum=0.0, minimum=FLT_TRUE_MIN, exclusive_maximum=1.0),
        "growth_interval": Field("int", 2000, "finite steps between growths", minimum=1, maximum=INT32_MAX),
        "hysteresis": Field("int", 1, "non-finite steps absorbed before a backoff", minimum=1,
                            maximum=INT32_MAX),
        "min": Field("float", 1.0, "floor of the scale (0 = none)", minimum=0.0, maximum=FLT_MAX),
        "max": Field("float", 16777216.0, "cap of the scale (inf = none)", exclusive_minimum=0.0,
                     maximum=FLT_MAX, allow_inf=True),
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
        "scale_dtype": _enum(("float32", "float64"), "float32",
                             "dtype the scale is held in: float32 (every framework's device tensor) or "
                             "float64 (a Python float: DeepSpeed, apex)"),
        "subnormal": _enum(("keep", "flush"), "keep",
                           "a product below the smallest normal: keep the subnormal (IEEE: torch, "
                           "Paddle) or flush it to 0 (Keras 3 on TensorFlow, XLA:CPU)"),
        "factor_arithmetic": _enum(("float64", "float32"), "float64",
                                   "scale x factor: formed in float64, rounded once (torch's kernel), or "
                                   "the factor rounded to float32 first (jmp, Flax, Paddle, Megatron)"),
        "backoff": _enum(("multiply", "divide"), "multiply",
                         "a backoff: scale x backoff_factor (torch, Keras, Flax, DeepSpeed, Paddle), or "
                         "scale / growth_factor (jmp; backoff_factor is then 1 / growth_factor)"),
    },
    "master_weights": {
        "enabled": Field("bool", True, "keep float32 masters when params are lower precision"),
        "dtype": _enum(("float32",), "float32", "dtype of master weights"),
    },
    "layout": {
        "channels_last": Field("bool", True, "NHWC for convolution nets"),
        "align": Field("int", 8, "dims that should be multiples of this", minimum=1, maximum=INT32_MAX),
        "on_misaligned": _enum(("ignore", "warn", "error"), "warn", "what to do with misaligned dims"),
    },
    "distributed": {
        "reduce_dtype": _enum(FLOAT_DTYPES, "float32", "dtype of the gradient all-reduce"),
    },
    "fp8": {
        "enabled": Field("bool", False, "run the layers of `ops` in FP8 (the rest stays in compute_dtype)"),
        "ops": Field("enumlist", ["linear"], "canonical ops that run FP8 where the backend can",
                     choices=FP8_OPS),
        "recipe": _enum(FP8_RECIPES, "tensorwise",
                        "scaling: tensorwise | rowwise | rowwise_gw_hp (rowwise, grad-weight in high "
                        "precision) | delayed (scales from an amax history)"),
        "amax_history": Field("int", 16, "amax history length (recipe = 'delayed' only)", minimum=1,
                              maximum=MAX_AMAX_HISTORY),
        "forward_format": _enum(("e4m3",), "e4m3", "FP8 format of activations and weights"),
        "gradient_format": _enum(("e5m2", "e4m3"), "e5m2", "FP8 format of the gradients"),
        "dims_multiple": Field("int", 16, "layers whose dims are not multiples of this stay in "
                                          "compute_dtype (reported)", minimum=1, maximum=INT32_MAX),
    },
}

OVERRIDE: dict[str, Field] = {
    "modules": Field("strlist", [], "fnmatch globs on dotted module paths"),
    "types": Field("strlist", [], "canonical op names or native layer class names"),
    "compute_dtype": _enum(COMPUTE_DTYPES, None, "compute dtype of matched modules"),
    "param_dtype": _enum(FLOAT_DTYPES, None, "parameter dtype of matched modules"),
    "fp8": Field("bool", None, "true: matched modules run FP8 ([fp8] recipe); false: never"),
}

DEFAULTS: dict[str, Any] = {
    **{k: f.default for k, f in TOP.items() if k != "extends"},
    **{t: {k: f.default for k, f in fields.items()} for t, fields in TABLES.items()},
    "overrides": [],
}


# ---------------------------------------------------------------- validation of one file's layer

Message = str | Callable[[], str]


class Problems:
    """Collects located problems. Past ``LIMIT`` a problem is only counted (its message is never
    built, so hostile input stays fast); :meth:`lines` ends with "... and N more"."""

    LIMIT = 20

    def __init__(self, source: str) -> None:
        self.source = source
        self.items: list[str] = []
        self.count = 0

    def add(self, path: str, message: Message) -> None:
        self.count += 1
        if len(self.items) < self.LIMIT:
            text = message() if callable(message) else message
            self.items.append(f"{self.source}: {path}: {text}" if path else f"{self.source}: {text}")

    def lines(self) -> list[str]:
        more = self.count - len(self.items)
        return self.items + ([f"{self.source}: ... and {more} more problem{'s' if more > 1 else ''} "
                              f"(fix the ones above first)"] if more else [])

    def raise_if_any(self) -> None:
        if self.count:
            from unimp.errors import PolicyError

            raise PolicyError(self.lines())


def show(value: Any) -> str:
    """A short description of any value for a message, built in bounded time and memory.

    >>> show("x" * 100), show(10**400), show([[1]] * 9)
    ("a string 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'...", 'an integer of 401 digits', 'a list of 9 items')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean {'true' if value else 'false'}"
    if isinstance(value, str):
        return f"a string {value[:40]!r}{'...' if len(value) > 40 else ''}"
    if isinstance(value, int):
        if value.bit_length() > 128:
            return f"an integer of {len(str(abs(value))) if value.bit_length() < 13000 else 'over 4000'} digits"
        return f"an integer {value}"
    if isinstance(value, float):
        return f"a number {value!r}"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"a table of {len(value)} keys"
    return f"a {type(value).__name__[:40]}"


def short(value: Any) -> str:
    """``value`` as it would be quoted in a message (strings truncated, anything else :func:`show`)."""
    if isinstance(value, str):
        return f"{value[:40]!r}{'...' if len(value) > 40 else ''}"
    return show(value)


def hint(word: Any, choices: Any) -> str | None:
    """:func:`unimp.policy.ops.suggest` for short strings only (difflib is slow on long ones)."""
    return suggest(word, choices) if isinstance(word, str) and len(word) <= 64 else None


def _type_name(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), f"a {type(value).__name__[:40]}")


def _unknown_key(key: Any, known: list[str], path: str, problems: Problems) -> None:
    def message() -> str:
        h = hint(key, known)
        fix = f"did you mean '{h}'?" if h else f"valid keys: {', '.join(known)}"
        return f"unknown key {short(key)} ({fix})"

    problems.add(path, message)


def _bad_string(value: str, field: Field, blank_ok: bool = False) -> str | None:
    """Why a string cannot be used (too long, blank, unencodable), or None."""
    if len(value) > field.max_len:
        return f"{len(value)} characters; at most {field.max_len}"
    if not blank_ok and not value.strip():
        return "expected a non-empty string, got a blank one"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"contains a lone surrogate (\\u{ord(value[e.start]):04x} at character {e.start}); not valid text"
    return None


def check_value(field: Field, value: Any, path: str, problems: Problems) -> Any:
    """Check one value against its field; returns the normalised value (or None when bad)."""
    kind = field.kind
    if kind == "str":
        if not isinstance(value, str):
            problems.add(path, lambda: f"expected a non-empty string, got {show(value)}")
            return None
        why = _bad_string(value, field)
        if why:
            problems.add(path, why)
            return None
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            problems.add(path, lambda: f"expected true or false, got {show(value)}")
            return None
        return value
    if kind == "enum":
        if value is None and field.default is None:
            return None
        if not isinstance(value, str) or value not in field.choices:
            def message() -> str:
                h = hint(value, field.choices)
                tail = f" (did you mean '{h}'?)" if h else ""
                return f"{short(value)} is not one of {', '.join(field.choices)}{tail}"

            problems.add(path, message)
            return None
        return value
    if kind in ("int", "float"):
        return _check_number(field, value, path, problems)
    if kind in ("oplist", "strlist", "enumlist"):
        return _check_list(field, value, path, problems)
    raise AssertionError(kind)


def _number_in_string(value: str) -> str:
    """A hint for a number written as a string (YAML 1.1 reads ``6.5e4`` as one)."""
    try:
        if len(value) > 64:
            return ""
        float(value)
    except ValueError:
        return ""
    if "e" in value.lower():
        return (" (a number written as a string: YAML 1.1 reads 6.5e4 as a string; write it with a dot and "
                "a signed exponent, 6.5e+4, or plainly, 65000.0)")
    return " (a number written as a string: remove the quotes)"


def _check_number(field: Field, value: Any, path: str, problems: Problems) -> Any:
    word = "an integer" if field.kind == "int" else "a number"
    if field.allow_auto and value == "auto":
        return value
    if field.allow_auto:
        word += ' or "auto"'
    if field.allow_inf and isinstance(value, str) and value in ("inf", "+inf"):
        value = math.inf  # JSON has no infinity: `unimp show --format json` writes "inf"
    if isinstance(value, bool) or not isinstance(value, int | float):
        tail = _number_in_string(value) if isinstance(value, str) else ""
        problems.add(path, lambda: f"expected {word}, got {show(value)}{tail}")
        return None
    if field.kind == "int" and not isinstance(value, int):
        problems.add(path, lambda: f"expected an integer, got {show(value)}")
        return None
    if isinstance(value, float) and math.isnan(value):
        problems.add(path, "NaN is not allowed")
        return None
    if isinstance(value, float) and math.isinf(value):
        if field.allow_inf and value > 0:
            return value
        problems.add(path, "must be finite" + (" (or inf)" if field.allow_inf else ""))
        return None
    bounds: list[tuple[float | None, Callable[[Any, float], bool], str]] = [
        (field.exclusive_minimum, lambda v, b: v > b, ">"), (field.minimum, lambda v, b: v >= b, ">="),
              (field.maximum, lambda v, b: v <= b, "<="), (field.exclusive_maximum, lambda v, b: v < b, "<")]
    for bound, ok, op in bounds:
        if bound is not None and not ok(value, bound):  # int/float comparison is exact: no overflow
            why = {FLT_MAX: "the largest float32", FLT_TINY: "the smallest normal float32",
                   FLT_TRUE_MIN: "the smallest float32 (subnormal)",
                   INT32_MAX: "the largest int32 (counters are int32 on device)"}.get(bound)
            tail = f", {why}" if why else ""
            inf = "; use inf for no cap" if field.allow_inf and op == "<=" else ""
            shown = bound if isinstance(bound, int) else f"{bound:g}"
            problems.add(path, f"must be {op} {shown}{tail}; got {show(value)}{inf}")
            return None
    return float(value) if field.kind == "float" else value


def _check_list(field: Field, value: Any, path: str, problems: Problems) -> Any:
    if not isinstance(value, list):
        problems.add(path, lambda: f"expected a list, got {show(value)}")
        return None
    if len(value) > field.max_items:
        problems.add(path, f"{len(value)} items; a list here holds at most {field.max_items}")
        return None
    out: list[str] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"{path}[{i}]"
        if not isinstance(item, str) or not item:
            def not_string(item: Any = item) -> str:
                return f"expected a non-empty string, got {show(item)}"

            problems.add(where, not_string)
            continue
        why = _bad_string(item, field, blank_ok=True) if field.kind == "strlist" else None
        if why:
            problems.add(where, why)
            continue
        if field.kind == "oplist" and item not in CANONICAL_OPS:
            def message(item: str = item) -> str:
                h = hint(item, CANONICAL_OPS)
                tail = f"did you mean '{h}'?" if h else "`unimp ops` lists the canonical ops"
                return f"unknown op {short(item)} ({tail})"

            problems.add(where, message)
            continue
        if field.kind == "enumlist" and item not in field.choices:
            def not_a_choice(item: str = item) -> str:
                return f"{short(item)} is not one of {', '.join(field.choices)}"

            problems.add(where, not_a_choice)
            continue
        if item in seen:
            def twice(item: str = item) -> str:
                return f"{short(item)} is listed twice"

            problems.add(where, twice)
            continue
        seen.add(item)
        out.append(item)
    return out


def _too_many_keys(value: dict[Any, Any], known: list[str], path: str, problems: Problems) -> bool:
    """Refuse a table with far more keys than the format has, naming a few, without a full scan."""
    if len(value) <= 2 * len(known) + 8:
        return False
    unknown = [short(k) for k in itertools.islice((k for k in value if k not in known), 3)]
    problems.add(path, f"{len(value)} keys; this table has at most {len(known)} (unknown: "
                       f"{', '.join(unknown)}, ...; valid keys: {', '.join(known)})")
    return True


def check_layer(raw: Any, problems: Problems) -> dict[str, Any]:
    """Validate one file's own content (before `extends` is applied); returns it normalised."""
    if not isinstance(raw, dict):
        problems.add("", lambda: f"a policy must be a table of keys, got {show(raw)}")
        return {}
    known = [*TOP, *TABLES, "overrides"]
    if _too_many_keys(raw, known, "", problems):
        return {}
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
        problems.add(path, lambda: f"expected a table, got {show(value)}")
        return {}
    if _too_many_keys(value, list(fields), path, problems):
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


def _class_name(t: str) -> bool:
    """A native layer class name: an identifier starting upper-case (``Linear``, ``BatchNorm2d``)."""
    return t.isidentifier() and t[0].isupper()


def _check_overrides(value: Any, problems: Problems) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        problems.add("overrides", lambda: f"expected a list of tables ([[overrides]]), got {show(value)}")
        return []
    if len(value) > MAX_ITEMS:
        problems.add("overrides", f"{len(value)} overrides; a policy holds at most {MAX_ITEMS} "
                                  f"(merge them: one override takes many globs and types)")
        return []
    out = []
    for i, item in enumerate(value):
        path = f"overrides[{i}]"
        table = _check_table(OVERRIDE, item, path, problems)
        if not isinstance(item, dict):
            continue
        if not table.get("modules") and not table.get("types"):
            problems.add(path, "matches nothing: give `modules` (globs on module paths) and/or `types`")
        if all(table.get(k) is None for k in ("compute_dtype", "param_dtype", "fp8")):
            problems.add(path, "changes nothing: give compute_dtype, param_dtype and/or fp8")
        for j, t in enumerate(table.get("types", [])):
            if t in CANONICAL_OPS or _class_name(t):
                continue

            def message(t: str = t) -> str:
                h = hint(t, CANONICAL_OPS)
                tail = f" (did you mean '{h}'?)" if h and t[:1].islower() else ""
                return (f"{short(t)} is neither a canonical op nor a native class name (an identifier "
                        f"starting upper-case, e.g. 'Linear'), so it matches nothing{tail}")

            problems.add(f"{path}.types[{j}]", message)
        for j, g in enumerate(table.get("modules", [])):
            if not g.strip():
                problems.add(f"{path}.modules[{j}]", "an empty glob matches nothing")
        out.append(table)
    return out


def check_resolved(policy: dict[str, Any], problems: Problems) -> None:
    """Checks that span several keys, run on the fully resolved policy."""
    ls = dict(policy["loss_scale"])
    shown = "\"auto\": " if ls["initial"] == "auto" else ""
    if shown:  # checked here at 2^16; a backend starting elsewhere checks its own (LossScaleSpec.starting_at)
        ls["initial"] = AUTO_INITIAL
    if ls["min"] > ls["initial"]:
        problems.add("loss_scale.min", f"min ({ls['min']:g}) is above initial ({shown}{ls['initial']:g})")
    if ls["mode"] == "dynamic" and not ls["skip_nonfinite"]:
        import warnings

        from unimp.errors import UnimpWarning

        warnings.warn(f"{problems.source}: loss_scale.skip_nonfinite: false with mode = 'dynamic' applies the "
                      f"non-finite steps that make the scale back off (parameters become NaN); set "
                      f"skip_nonfinite = true unless that is what you want", UnimpWarning, stacklevel=2)
    if ls["initial"] > ls["max"]:
        problems.add("loss_scale.initial", f"initial ({shown}{ls['initial']:g}) is above max ({ls['max']:g})")
    if ls["subnormal"] == "flush" and ls["mode"] != "none" and ls["initial"] < FLT_TINY:
        problems.add("loss_scale.initial", f"initial ({ls['initial']:g}) is below 2^-126 with subnormal = 'flush': "
                                           f"a flushing system holds it as 0 (Keras 3 on TensorFlow reads "
                                           f"initial_scale=2**-140 back as 0.0) and never scales again; set "
                                           f"initial >= 2^-126 or subnormal = 'keep'")
    if ls["backoff"] == "divide" and ls["backoff_factor"] != 1.0 / ls["growth_factor"]:
        problems.add("loss_scale.backoff_factor",
                     f"backoff = 'divide' backs off by scale / growth_factor, so backoff_factor must be 1 / "
                     f"growth_factor = {1.0 / ls['growth_factor']!r}; got {ls['backoff_factor']!r}")
    fp8 = policy["fp8"]
    if fp8["recipe"] != "delayed" and fp8["amax_history"] != TABLES["fp8"]["amax_history"].default:
        problems.add("fp8.amax_history", f"applies to recipe = 'delayed' only (recipe is {fp8['recipe']!r}: its "
                                         f"scales come from the current tensor); remove it or set "
                                         f"recipe = 'delayed'")


# ---------------------------------------------------------------- JSON Schema


def _field_schema(field: Field) -> dict[str, Any]:
    k = field.kind
    if k == "str":
        return {"type": "string", "minLength": 1, "maxLength": field.max_len, "description": field.doc}
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
        if field.maximum is not None and not field.allow_inf:  # a file's inf must pass: no finite maximum
            s["maximum"] = field.maximum
        if field.exclusive_maximum is not None:
            s["exclusiveMaximum"] = field.exclusive_maximum
        alternatives = [{"const": "inf"}] if field.allow_inf else []  # JSON has no infinity: "inf" stands for it
        alternatives += [{"const": "auto"}] if field.allow_auto else []
        return {"anyOf": [s, *alternatives], "description": field.doc} if alternatives else s
    items = {"oplist": {"enum": list(CANONICAL_OPS)}, "enumlist": {"enum": list(field.choices)},
             "strlist": {"type": "string", "minLength": 1, "maxLength": field.max_len}}[k]
    return {"type": "array", "items": items, "uniqueItems": True, "maxItems": field.max_items,
            "description": field.doc}


def _object(fields: dict[str, Field]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "properties": {k: _field_schema(f) for k, f in fields.items()}}


def json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of one policy file."""
    override = _object(OVERRIDE)
    override["anyOf"] = [{"required": ["modules"]}, {"required": ["types"]}]
    props = {k: _field_schema(f) for k, f in TOP.items()}
    props.update({t: _object(f) for t, f in TABLES.items()})
    props["overrides"] = {"type": "array", "items": override, "maxItems": MAX_ITEMS}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "unimp policy",
            "type": "object", "additionalProperties": False, "properties": props}


# ---------------------------------------------------------------- the bounds, for people


def bounds_table() -> str:
    """The bounds of every number, string and list of the format, as a Markdown table.

    >>> print(bounds_table().splitlines()[2])
    | `name` | string | 1 to 256 characters |
    """
    rows = ["| key | kind | accepted |", "|---|---|---|"]

    names = {FLT_MAX: "3.4028235e38 (largest float32)", FLT_TINY: "2^-126 (smallest normal float32)",
             FLT_TRUE_MIN: "2^-149 (smallest subnormal float32)",
             INT32_MAX: "2147483647 (largest int32)"}

    def num(x: float) -> str:
        return names.get(x, f"{x:g}")

    def number(f: Field) -> str:
        lo = f">= {num(f.minimum)}" if f.minimum is not None else f"> {num(f.exclusive_minimum or 0)}"
        hi = f"< {num(f.exclusive_maximum)}" if f.exclusive_maximum is not None else f"<= {num(f.maximum or 0)}"
        return (f"{lo}, {hi}" + (", or inf (\"inf\" in JSON)" if f.allow_inf else "")
                + (", or \"auto\" (the framework's own)" if f.allow_auto else ""))

    def row(path: str, f: Field) -> None:
        if f.kind == "str":
            rows.append(f"| `{path}` | string | 1 to {f.max_len} characters |")
        elif f.kind in ("int", "float"):
            rows.append(f"| `{path}` | {'integer' if f.kind == 'int' else 'number'} | {number(f)} |")
        elif f.kind in ("oplist", "strlist", "enumlist"):
            rows.append(f"| `{path}` | list | at most {f.max_items} distinct items"
                        + (f" of at most {f.max_len} characters |" if f.kind == "strlist" else " |"))

    for k, f in TOP.items():
        row(k, f)
    for t, fields in TABLES.items():
        for k, f in fields.items():
            row(f"{t}.{k}", f)
    rows.append(f"| `overrides` | list | at most {MAX_ITEMS} tables |")
    for k, f in OVERRIDE.items():
        row(f"overrides[].{k}", f)
    return "\n".join(rows)
