"""Reading what users paste, in bounded work and without executing anything: keyword-argument lists
(``k=v, ...``), calls (``Call(k=v); Call(...)``, ``x = Call(...)``, ``with Call(...):``, scripts), JSON
tables, YAML lines and command lines; every parsed configuration checked as plain data (:func:`plain`).

>>> parse_calls("GradScaler(init_scale=2**10); growth_interval=10", "x")
[('GradScaler', {'init_scale': 1024}), (None, {'growth_interval': 10})]
"""

from __future__ import annotations

import ast
import datetime
import json
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from unimp.dtypes import FLT_MAX
from unimp.errors import PolicyError
from unimp.migrate.values import MAX_BITS, MAX_NAME, Name, bad, name, number
from unimp.policy.spec import short, show

MAX_TEXT = 65536  # characters of a pasted configuration (an AST of a longer one is not worth building)
MAX_VALUES = 20_000  # values (tables, lists, scalars; an alias counted each time it is used) in one source
MAX_DEPTH = 32  # nesting of tables and lists in one source (real configurations nest 3 or 4 deep)


def pasted_json(text: str, source: str, key: str, what: str) -> Any:
    """``text`` (a JSON document pasted or written by a script) parsed in bounded work: deep nesting and
    duplicate keys are located errors (``what``: what it should have been), never a RecursionError."""
    from unimp.policy.resolve import parse_text

    try:
        return parse_text(text, "json")
    except PolicyError as e:
        raise bad(source, key, f"{what} ({e})") from None


def pasted_yaml(text: str, source: str, expected: str) -> Any:
    """Lines pasted from a YAML file (``precision: 16``) as the plain mapping they parse to (bounded, as
    :func:`plain`); a located error saying what was ``expected`` when they are not a mapping."""
    from unimp.policy.resolve import parse_text

    try:
        parsed = parse_text(text, "yaml")
    except PolicyError:  # parse_text turns every parser error into one
        parsed = None
    if not isinstance(parsed, Mapping):
        raise bad(source, "", f"cannot read {short(text)}: expected {expected}")
    return plain(parsed, source)


def pasted_arguments(raw: Any, source: str, command_line: Callable[[str, str], dict[str, Any]], expected: str,
                     is_command_line: Callable[[str], bool] = lambda text: "--" in text) -> Any:
    """A trainer's arguments as pasted: a JSON table, a command line (``command_line`` parses it), or YAML
    lines; anything else (a file's parsed table) as it is. ``expected`` says what was expected."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except ValueError as e:
            raise bad(source, "", f"not a JSON table ({e})") from None
    if is_command_line(text):
        return command_line(text, source)
    return pasted_yaml(text, source, expected)


def plain(raw: Any, source: str) -> Any:
    """``raw`` (a parsed configuration) as plain data, checked in bounded time and memory: tables with
    string keys, lists, strings, numbers, booleans and null; at most ``MAX_VALUES`` values (a YAML
    alias counts each time it is used, so an alias bomb stops here) nested ``MAX_DEPTH`` deep.

    >>> plain({"fp16": {"enabled": True}}, "x")
    {'fp16': {'enabled': True}}
    >>> plain({1: 2}, "x")
    Traceback (most recent call last):
    unimp.errors.PolicyError: x: (top level): a key is a string, got an integer 1; quote it
    """
    out: list[Any] = [None]
    stack: list[tuple[Any, list[Any] | dict[str, Any], Any, str, int]] = [(raw, out, 0, "", 0)]
    count = 0
    while stack:
        value, parent, slot, where, depth = stack.pop()
        count += 1
        # a table or list of more items than the bound allows is refused before its items are walked
        if count > MAX_VALUES or (isinstance(value, Mapping | list | tuple)
                                  and len(value) > MAX_VALUES - count - len(stack)):
            raise bad(source, "", f"over {MAX_VALUES} values (YAML aliases count each time they are used); a "
                                  f"mixed-precision configuration holds far fewer: pass the file itself, "
                                  f"without aliases")
        if depth > MAX_DEPTH:
            raise bad(source, where, f"nested over {MAX_DEPTH} levels deep; a configuration is a few levels deep")
        if isinstance(value, Mapping):
            table: dict[str, Any] = {}
            for key, item in value.items():
                if not isinstance(key, str):
                    raise bad(source, where or "(top level)", f"a key is a string, got {show(key)}; quote it")
                table[key] = None
                stack.append((item, table, key, f"{where}{'.' if where else ''}{key[:MAX_NAME]}", depth + 1))
            parent[slot] = table
        elif isinstance(value, list | tuple):
            items: list[Any] = [None] * len(value)
            for i, item in enumerate(value):
                stack.append((item, items, i, f"{where}[{i}]", depth + 1))
            parent[slot] = items
        elif value is None or isinstance(value, str | bool | float):
            parent[slot] = value
        elif isinstance(value, int):
            if value.bit_length() > MAX_BITS:
                raise bad(source, where, f"{show(value)} is out of range (at most {FLT_MAX:.4g}); write the value "
                                         f"the system runs")
            parent[slot] = value
        elif isinstance(value, datetime.date | datetime.time):  # YAML timestamps in unrelated keys: their text
            parent[slot] = value.isoformat()
        elif isinstance(value, set | frozenset):
            raise bad(source, where, f"a set ({len(value)} items) is not a configuration value; write a list")
        else:
            raise bad(source, where, f"{show(value)} is not a configuration value (a table, list, string, number, "
                                     f"boolean or null); write it as one")
        if len(stack) > MAX_VALUES:
            raise bad(source, where, f"over {MAX_VALUES} values; a mixed-precision configuration holds far fewer")
    return out[0]


@dataclass(frozen=True)
class Call:
    """One call as written in pasted code: ``name`` its dotted name (``None`` for a bare ``k=v`` list),
    literal positional ``args`` and keyword ``kwargs``."""

    name: str | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: str | None = None  # the name it is assigned to (``policy = Policy(...)``)

    @property
    def last(self) -> str | None:
        """The call's own name (``set_global_policy`` of ``keras.mixed_precision.set_global_policy``)."""
        return None if self.name is None else self.name.rpartition(".")[2]


DTYPE_CALLS = ("float32", "float16", "bfloat16", "float64", "asarray", "array", "tensor", "half_dtype",
               "full_dtype")  # jnp.float32(2**15)


def calls(text: str, source: str, known: Any = None) -> list[Call]:
    """The calls in pasted code, literals only (nothing is executed): ``k=v, ...`` lists,
    ``Call(...)``, ``x = Call(...)``, ``with Call(...):`` and calls spanning lines; a dotted name as a
    value (``torch.float16``) is kept as its text, a dtype constructor (``jnp.float32(1024.0)``) as its
    argument.

    >>> [(c.name, c.args, c.kwargs) for c in calls("trainer = pl.Trainer(precision='bf16-mixed')", "x")]
    [('pl.Trainer', (), {'precision': 'bf16-mixed'})]
    >>> calls("with torch.autocast('cuda', dtype=torch.float16):", "x")[0].kwargs
    {'dtype': 'torch.float16'}
    """
    if len(text) > MAX_TEXT:
        raise bad(source, "", f"{len(text)} characters; a pasted configuration is at most {MAX_TEXT}")
    parts = _statements(text, known)
    out: list[Call] = []
    for part in parts:
        node: ast.expr | None = _call_of(part, known)
        code = part
        if node is None:
            try:
                code = f"_({part})"  # k=v, ...: the source segments of its values are read from this text
                node = ast.parse(code, mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                raise bad(source, "", f"cannot read {short(part)}: expected key=value pairs or Call(key=value, ...)") \
                    from None
        if not isinstance(node, ast.Call):
            raise bad(source, "", f"cannot read {short(part)}: expected keyword arguments (key=value)")
        name = _dotted(node.func)
        if any(isinstance(a, ast.Starred) for a in node.args):
            raise bad(source, name or "", f"{short(part)}: *args cannot be read; write the arguments out")
        args = tuple(_value(a, code, source, f"{name}() argument {i + 1}") for i, a in enumerate(node.args))
        kwargs: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise bad(source, "", f"{short(part)}: **kwargs cannot be read; write the keys out")
            kwargs[kw.arg] = _value(kw.value, code, source, kw.arg)
        out.append(Call(None if name == "_" else name, tuple(plain(list(args), source)), plain(kwargs, source),
                        _target(part)))
    return out


def _target(part: str) -> str | None:
    """``x`` of ``x = Call(...)``."""
    try:
        body = ast.parse(part).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    st = body[0] if len(body) == 1 else None
    if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
        return st.targets[0].id
    return None


def _statements(text: str, known: Any = None) -> list[str]:
    """The statements of ``text``: as Python parses it when it does (calls may span lines), else its
    lines and ``;``-separated parts. A script (loops, functions, calls such as ``print(...)``) is read
    for the ``known`` calls only, wherever they are, as the system runs them: the rest sets no precision."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        try:
            text = textwrap.dedent(text)  # lines pasted from inside a function or loop
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            tree = None
    code = ast.Expr | ast.Assign | ast.With | ast.Return
    script = _script(tree, text, known) if tree is not None and known else None
    if script:
        return script
    if tree is not None and tree.body and all(isinstance(st, code | ast.Import | ast.ImportFrom) for st in tree.body):
        # imports name modules, they set nothing: skipped
        segments = (ast.get_source_segment(text, st) or "" for st in tree.body if isinstance(st, code))
        return [p.strip() for p in segments if p.strip()]
    return [p.strip() for p in text.replace("\n", ";").split(";") if p.strip()]


def _script(tree: ast.Module, text: str, known: Any) -> list[str] | None:
    """The ``known`` calls of a script (each as its statement: ``x = Call(...)``, ``with Call(...):``,
    ``Call(...)``), in source order; None when ``text`` is not a script (only simple statements, each a
    known call, an import or ``k=v``) or holds no known call. A call named like a known one
    (``GradScalar``) is kept, so its unknown name is reported, never skipped."""
    import difflib

    def typo(name: str) -> bool:  # GradScalar for GradScaler (set_global_policy is not global_policy)
        return bool(difflib.get_close_matches(name, list(known), n=1, cutoff=0.9))

    def last(node: ast.Call) -> str:
        return _dotted(node.func).rpartition(".")[2]

    simple = ast.Expr | ast.Assign | ast.With | ast.Return | ast.Import | ast.ImportFrom
    top = [st for st in tree.body if not isinstance(st, ast.Import | ast.ImportFrom)]
    calls_ = [st.value if isinstance(st, ast.Expr | ast.Assign | ast.Return) else st.items[0].context_expr
              if isinstance(st, ast.With) and st.items else None for st in top]
    if all(isinstance(st, simple) for st in tree.body) and all(
            not isinstance(c, ast.Call) or last(c) in known or _dotted(c.func) == "?" for c in calls_):
        return None
    parent: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[id(child)] = node
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not (last(node) in known or typo(last(node))):
            continue
        up, inside = parent.get(id(node)), False
        while up is not None and not inside:  # a call inside a known call is its argument
            inside = isinstance(up, ast.Call) and last(up) in known
            up = parent.get(id(up))
        if inside:
            continue
        holder = parent.get(id(node))
        segment = ast.get_source_segment(text, node) or ""
        if isinstance(holder, ast.Assign) and len(holder.targets) == 1 and isinstance(holder.targets[0], ast.Name):
            segment = f"{holder.targets[0].id} = {segment}"
        elif isinstance(holder, ast.withitem):
            segment = f"with {segment}:"
        found.append((node.lineno, node.col_offset, segment))
    return [seg for _, _, seg in sorted(found)] or None


def _call_of(part: str, known: Any = None) -> ast.Call | None:
    """The call a statement makes (``Call(...)``, ``x = Call(...)``, ``with Call(...) as y:``), or None."""
    code = part + " pass" if part.rstrip().endswith(":") else part
    try:
        body = ast.parse(code).body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(body) != 1:
        return None
    st = body[0]
    node = st.items[0].context_expr if isinstance(st, ast.With) else st.value if isinstance(
        st, ast.Expr | ast.Assign | ast.Return) else None
    if not isinstance(node, ast.Call):
        return None
    if isinstance(st, ast.Assign) and known is not None and _dotted(node.func).rpartition(".")[2] not in known:
        return None  # `init_scale=f(x)`: a keyword argument, not a call
    return node


def _value(node: ast.AST, part: str, source: str, key: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        pass
    else:  # a set of names (Paddle's docs write custom_white_list={'conv2d'}): a list, in a stable order
        names = isinstance(value, set | frozenset) and all(isinstance(v, str) for v in value)
        return sorted(value) if names else value
    value = _power(node, source, key)
    if value is not None:
        return value
    if isinstance(node, ast.Attribute | ast.Name):  # torch.float16, an optimizer variable: kept as their name
        dotted = _dotted(node)
        if dotted != "?":
            return Name(dotted)
    if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
        func = node.func.func if isinstance(node.func, ast.Call) and not node.func.args else node.func
        if _dotted(func).rpartition(".")[2] in DTYPE_CALLS:  # jnp.float32(x), jmp.half_dtype()(x)
            return _value(node.args[0], part, source, key)
    if isinstance(node, ast.Call) and _dotted(node.func) != "?" and key.endswith("argument 1"):
        return Name(_dotted(node.func) + "()")  # an object built in place (LossScaleOptimizer(Adam(), ...))
    segment = ast.get_source_segment(part, node) or ""
    raise bad(source, key, f"{short(segment)} is not a literal; write the value (a number, string, boolean or list)")


def parse_calls(text: str, source: str) -> list[tuple[str | None, dict[str, Any]]]:
    """Keyword arguments as users paste them (:func:`calls` without positional arguments).

    >>> parse_calls("GradScaler(init_scale=1024.0); growth_interval=10", "x")
    [('GradScaler', {'init_scale': 1024.0}), (None, {'growth_interval': 10})]
    """
    out = []
    for c in calls(text, source):
        if c.args:
            raise bad(source, c.name or "", f"{name(c.name or '')}(...): positional arguments cannot be read here; "
                                            f"write them as key=value")
        out.append((c.last, c.kwargs))
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
    if "=" in first or "(" in first or " " in first.strip():  # a name has no spaces ("from x import y" is code)
        return None, raw
    return first.strip().strip("'\""), rest.strip()


def _power(node: ast.AST, source: str, key: str) -> float | int | None:
    """``2**16`` / ``2.0**-3`` (how scales are usually written) without evaluating anything else;
    a power out of every dtype's range is refused before it is computed."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)):
        return None
    try:
        base, exp = ast.literal_eval(node.left), ast.literal_eval(node.right)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (base, exp)):
        return None
    for v in (base, exp):
        number(source, key, v)  # type and range of each side (an integer of 4,000 digits stops here)
    if base != 0 and abs(exp) * abs(math.log2(abs(base))) > MAX_BITS:
        raise bad(source, key, f"a power of {abs(exp) * abs(math.log2(abs(base))):.3g} bits is out of range "
                               f"(at most {FLT_MAX:.4g}); write the value the system runs")
    try:
        power: float | int = base ** exp
        return power
    except (OverflowError, ZeroDivisionError):
        raise bad(source, key, "the power is out of range or divides by zero; write the value") from None


def _dotted(func: ast.AST) -> str:
    """``a.b.c`` of a name or attribute chain; ``?`` for anything else."""
    parts: list[str] = []
    while isinstance(func, ast.Attribute) and len(parts) < 16:
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return "?"
    return ".".join([func.id, *reversed(parts)])


def kwargs_of(raw: Any, source: str, calls_: Mapping[str, str],
              positional: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, dict[str, Any]]:
    """Group pasted keyword arguments by role: ``calls_`` maps call names (``GradScaler``) to roles;
    a bare ``k=v`` list goes to the first role. ``positional`` names a call's positional parameters
    (its signature); without it positional arguments are refused. A dict is taken as
    ``{role: kwargs}`` when its keys are roles, else as the first role's kwargs."""
    roles = list(dict.fromkeys(calls_.values()))
    if isinstance(raw, Mapping):
        if raw and all(k in roles or k in calls_ for k in raw):
            return {calls_.get(k, k): dict(v) for k, v in raw.items() if _table(v, source, k)}
        return {roles[0]: dict(raw)}
    if not isinstance(raw, str):
        raise bad(source, "", f"expected a string or a table, got {show(raw)}")
    out: dict[str, dict[str, Any]] = {}
    for c in calls(raw, source, calls_):
        role = roles[0] if c.name is None else calls_.get(c.last or "")
        if role is None:
            raise bad(source, c.name or "", f"unknown call {short(c.name)}; expected one of {', '.join(calls_)}")
        kw = dict(c.kwargs)
        if c.args:
            names = (positional or {}).get(c.last or "", ())
            if len(c.args) > len(names):
                raise bad(source, c.name or "", f"{len(c.args)} positional arguments; {name(c.last or '')} takes "
                                                f"{len(names)} ({', '.join(names) or 'none'}): write them as key=value")
            for k, v in zip(names, c.args, strict=False):
                if k in kw:
                    raise bad(source, f"{c.name}.{k}", "given both by position and by name; keep one")
                kw[k] = v
        out.setdefault(role, {}).update(kw)
    return out


def _table(value: Any, source: str, key: str) -> bool:
    if not isinstance(value, Mapping):
        raise bad(source, key, f"expected a table of keyword arguments, got {show(value)}")
    return True
