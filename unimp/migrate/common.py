"""What every importer and exporter shares: the commented policy draft, located errors, the
argument parsers for the forms users paste (``k=v, ...``, ``Call(k=v); Call(...)``, JSON), and the
export check (re-import the native config, list what differs).

>>> d = Draft("torch", "GradScaler", extends="torch_autocast_cuda", why="torch.amp.GradScaler")
>>> d.set("loss_scale.growth_interval", 100, "growth_interval")
>>> print(d.build().text.splitlines()[-1])
growth_interval = 100  # growth_interval
"""

from __future__ import annotations

import ast
import json
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import PolicyError, UnimpWarning, UnsupportedError
from ..loading import load, preset_names
from ..loss_scale import f32
from ..policy import Policy
from ..resolve import flatten
from ..spec import TABLES, short, show

MAX_TEXT = 65536  # characters of a pasted configuration (an AST of a longer one is not worth building)


@dataclass(frozen=True)
class Imported:
    """A policy read from another system's configuration.

    ``text`` is the policy file (TOML) with a comment on each key naming the source key it came
    from; ``ignored`` lists the source keys that are not precision settings.
    """

    system: str
    policy: Policy
    text: str
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class Exported:
    """A policy written as another system's configuration.

    ``config`` is the native configuration (a dict of keyword arguments or config sections, or a
    string for command-line / policy-string systems); ``text`` is it ready to paste;
    ``unexpressed`` holds one ``"key = value: why"`` line per policy key the system cannot express.
    """

    system: str
    config: Any
    text: str
    unexpressed: tuple[str, ...] = ()

    def strict(self) -> Exported:
        """``self``, or :class:`UnsupportedError` listing what the system cannot express."""
        if self.unexpressed:
            raise UnsupportedError(f"{self.system} cannot express {len(self.unexpressed)} key(s) of this policy:\n"
                                   + "\n".join(f"  {u}" for u in self.unexpressed)
                                   + "\n(drop --strict to export the rest, or change these keys)")
        return self


def has_knob(path: str) -> bool:
    """Whether the policy format has ``table.key`` (knobs added later are written only when known)."""
    table, _, key = path.partition(".")
    return key in TABLES.get(table, {})


def refuse(source: str, key: str, message: str, fix: str) -> UnsupportedError:
    """What the source says that unimp cannot express: names the source key and the fix."""
    return UnsupportedError(f"{source}: {key}: {message}; {fix}")


def bad(source: str, key: str, message: str) -> PolicyError:
    return PolicyError(f"{source}: {key}: {message}")


class Draft:
    """A policy being built from a source configuration, each key with the place it came from."""

    def __init__(self, system: str, source: str, extends: str, why: str) -> None:
        if extends not in preset_names():
            raise AssertionError(f"unknown preset {extends}")
        self.system, self.source = system, source
        self.extends, self.why = extends, why
        self.keys: dict[str, tuple[Any, str]] = {}
        self.notes: list[str] = []
        self.ignored: list[str] = []

    def set(self, path: str, value: Any, origin: str) -> None:
        """Set ``path`` (``"loss_scale.initial"`` or a top-level key) from ``origin`` (a source key,
        or a sentence such as ``"DeepSpeed default"``)."""
        self.keys[path] = (value, origin)

    def note(self, text: str, warn: bool = False) -> None:
        """A line for the file's header; ``warn`` also raises a :class:`UnimpWarning`."""
        self.notes.append(text)
        if warn:
            warnings.warn(f"{self.source}: {text}", UnimpWarning, stacklevel=3)

    def data(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": f"imported-{self.system}", "extends": self.extends}
        for path, (value, _) in self.keys.items():
            table, _, key = path.rpartition(".")
            (out.setdefault(table, {}) if table else out)[key] = value
        return out

    def build(self) -> Imported:
        try:
            policy = load(self.data())
        except PolicyError as e:
            raise PolicyError([self._locate(p) for p in e.problems]) from None
        return Imported(self.system, policy, self.render(), tuple(self.ignored))

    def _locate(self, problem: str) -> str:
        """A load problem (``<dict>: loss_scale.min: ...``) restated with the source key."""
        text = problem.removeprefix("<dict>: ")
        for path, (_, origin) in self.keys.items():
            if text.startswith(path + ":") or text.startswith(path + "["):
                return f"{self.source}: {origin}: {text[len(path) + 1:].strip()} (unimp key {path})"
        return f"{self.source}: {text}"

    def render(self) -> str:
        lines = [f"# Imported from {self.system} ({short(self.source)}) by `unimp import`.",
                 *(f"# {n}" for n in self.notes)]
        if self.ignored:
            lines.append(f"# Not precision settings (ignored): {', '.join(self.ignored)}")
        lines += [f'name = "imported-{self.system}"  # unimp import --from {self.system}',
                  f'extends = "{self.extends}"  # {self.why}']
        tables: dict[str, list[str]] = {}
        for path, (value, origin) in self.keys.items():
            table, _, key = path.rpartition(".")
            line = f"{key} = {toml_value(value)}  # {origin}"
            if table:
                tables.setdefault(table, []).append(line)
            else:
                lines.append(line)
        for table, rows in tables.items():
            lines += ["", f"[{table}]", *rows]
        return "\n".join(lines) + "\n"


def toml_value(value: Any) -> str:
    """One TOML value (inf written ``inf``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "inf" if math.isinf(value) and value > 0 else repr(value)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


# ---------------------------------------------------------------- what users paste

def parse_calls(text: str, source: str) -> list[tuple[str | None, dict[str, Any]]]:
    """Keyword arguments as users paste them, literals only (nothing is executed).

    >>> parse_calls("GradScaler(init_scale=1024.0); growth_interval=10", "x")
    [('GradScaler', {'init_scale': 1024.0}), (None, {'growth_interval': 10})]
    """
    if len(text) > MAX_TEXT:
        raise bad(source, "", f"{len(text)} characters; a pasted configuration is at most {MAX_TEXT}")
    out: list[tuple[str | None, dict[str, Any]]] = []
    for part in text.replace("\n", ";").split(";"):
        part = part.strip()
        if not part:
            continue
        try:
            node = ast.parse(part if "(" in part.split("=", 1)[0] else f"_({part})", mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            raise bad(source, "", f"cannot read {short(part)}: expected key=value pairs or Call(key=value, ...)") \
                from None
        if not isinstance(node, ast.Call) or node.args:
            raise bad(source, "", f"cannot read {short(part)}: expected keyword arguments (key=value)")
        name = _call_name(node.func)
        kwargs: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise bad(source, "", f"{short(part)}: **kwargs cannot be read; write the keys out")
            try:
                kwargs[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                value = _power(kw.value)
                if value is None:
                    raise bad(source, kw.arg, f"{short(ast.unparse(kw.value))} is not a literal; write the value "
                                              f"(a number, string, boolean or list)") from None
                kwargs[kw.arg] = value
        out.append((None if name == "_" else name, kwargs))
    return out


def leading_name(raw: Any) -> tuple[str | None, Any]:
    """``("fp16", "GradScalerKwargs(...)")`` from ``"fp16; GradScalerKwargs(...)"``: a bare first part
    (no ``=``, no call) is the system's name for a precision; anything else is left as it is.

    >>> leading_name("mixed_float16; LossScaleOptimizer(initial_scale=8.0)")
    ('mixed_float16', 'LossScaleOptimizer(initial_scale=8.0)')
    """
    if not isinstance(raw, str):
        return None, raw
    first, _, rest = raw.replace("\n", ";").partition(";")
    if "=" in first or "(" in first:
        return None, raw
    return first.strip().strip("'\""), rest.strip()


def _power(node: ast.AST) -> float | int | None:
    """``2**16`` / ``2.0**-3`` (how scales are usually written) without evaluating anything else."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        try:
            base, exp = ast.literal_eval(node.left), ast.literal_eval(node.right)
        except (ValueError, TypeError, SyntaxError):
            return None
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (base, exp)) and abs(exp) <= 1100:
            try:
                return base ** exp
            except (OverflowError, ZeroDivisionError):
                return None
    return None


def _call_name(func: ast.AST) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return "?"


def kwargs_of(raw: Any, source: str, calls: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Group pasted keyword arguments by role: ``calls`` maps call names (``GradScaler``) to roles;
    a bare ``k=v`` list goes to the first role. A dict is taken as ``{role: kwargs}`` when its keys
    are roles, else as the first role's kwargs."""
    roles = list(dict.fromkeys(calls.values()))
    if isinstance(raw, Mapping):
        if raw and all(k in roles or k in calls for k in raw):
            return {calls.get(k, k): dict(v) for k, v in raw.items() if _table(v, source, k)}
        return {roles[0]: dict(raw)}
    if not isinstance(raw, str):
        raise bad(source, "", f"expected a string or a table, got {show(raw)}")
    out: dict[str, dict[str, Any]] = {}
    for name, kw in parse_calls(raw, source):
        role = roles[0] if name is None else calls.get(name)
        if role is None:
            raise bad(source, name or "", f"unknown call {short(name)}; expected one of {', '.join(calls)}")
        out.setdefault(role, {}).update(kw)
    return out


def _table(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, Mapping):
        raise bad(source, key, f"expected a table of keyword arguments, got {show(value)}")
    return True


def check_keys(given: Mapping[str, Any], known: Mapping[str, Any] | tuple[str, ...], source: str,
               where: str = "") -> None:
    """Refuse keys the source system does not have (a typo would otherwise be dropped)."""
    from ..ops import suggest

    for key in given:
        if key not in known:
            h = suggest(key, list(known)) if isinstance(key, str) else None
            tail = f"did you mean '{h}'?" if h else f"known: {', '.join(known)}"
            raise bad(source, f"{where}{key}", f"unknown argument ({tail})")


def number(source: str, key: str, value: Any, kind: type = float, minimum: float | None = None) -> Any:
    """A numeric source value checked for type (``kind`` int or float) and lower bound."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok or (isinstance(value, float) and math.isnan(value)):
        word = "an integer" if kind is int else "a number"
        raise bad(source, key, f"expected {word}, got {show(value)}")
    if minimum is not None and value < minimum:
        raise bad(source, key, f"must be >= {minimum:g}; got {show(value)}")
    return int(value) if kind is int else float(value)


def flag(source: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(source, key, f"expected true or false, got {show(value)}")
    return value


# ---------------------------------------------------------------- export check

_DYNAMIC_ONLY = ("initial", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min", "max",
                 "growth_schedule", "on_max", "growth_requires_finite", "hysteresis_refill", "at_min",
                 "scale_dtype", "subnormal", "factor_arithmetic", "backoff")


def effective(policy: Policy) -> dict[str, Any]:
    """The policy's keys that change behaviour (``name``, knobs of an unused mode, and the factor
    arithmetic when both factors are float32 values, left out)."""
    flat = flatten(policy.to_dict())
    flat.pop("name", None)
    mode = flat.get("loss_scale.mode")
    for k in _DYNAMIC_ONLY:
        if mode != "dynamic" and not (mode == "static" and k == "initial"):
            flat.pop(f"loss_scale.{k}", None)
    factors = (flat.get("loss_scale.growth_factor"), flat.get("loss_scale.backoff_factor"))
    if all(f is None or f32(f) == f for f in factors):
        flat.pop("loss_scale.factor_arithmetic", None)  # float32 factors: both arithmetics round the same product
    g = flat.get("loss_scale.growth_factor")
    if g is not None and math.frexp(g)[0] == 0.5 and flat.get("loss_scale.backoff_factor") == 1.0 / g:
        flat.pop("loss_scale.backoff", None)  # a power-of-two factor: scale / g and scale * (1 / g) are one product
    if flat.get("param_dtype") == "float32":
        flat = {k: v for k, v in flat.items() if not k.startswith("master_weights.")}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items()}


def unexpressed(policy: Policy, native: Policy, system: str) -> tuple[str, ...]:
    """One line per key whose value the native configuration does not reproduce."""
    ours, theirs = effective(policy), effective(native)
    lines = []
    for key in sorted({*ours, *theirs}):
        a, b = ours.get(key), theirs.get(key)
        if key.startswith("ops.") and isinstance(a, tuple) and isinstance(b, tuple) and sorted(a) == sorted(b):
            continue  # an op category is a set: the order of its list changes nothing
        if a is not None and a != b:
            lines.append(f"{key} = {_fmt(a)}: {system} cannot express it (its configuration gives {_fmt(b)})")
    return tuple(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "nothing"
    return toml_value(v)


def finish(system: str, policy: Policy, config: Any, text: str,
           reimport: Callable[[Any], Imported]) -> Exported:
    """An :class:`Exported` whose ``unexpressed`` is what re-importing ``config`` does not give back."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        native = reimport(config).policy
    return Exported(system, config, text, unexpressed(policy, native, system))


def power_of_two(x: float) -> int | None:
    """``k`` when ``x == 2**k`` exactly, else None."""
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None


def take(draft: Draft, path: str, given: Mapping[str, Any], key: str, default: Any, *, prefix: str = "",
         kind: type = float, minimum: float | None = None, convert: Callable[[Any], Any] | None = None) -> Any:
    """Set ``path`` from source key ``key`` of ``given`` (or the system's ``default``), commented
    with where it came from; returns the value set."""
    where = f"{prefix}{key}"
    if key in given:
        raw = given[key]
        value = flag(draft.source, where, raw) if kind is bool else number(draft.source, where, raw, kind, minimum)
        origin = where
    else:
        value, origin = default, f"{where} not given: {draft.system} default"
    value = convert(value) if convert else value
    draft.set(path, value, origin)
    return value
