"""Source values checked and coerced: a number, a string, a flag, each refused with a located error
(:func:`bad`: the source file or ``<argument>`` and the key) that says what was expected.

>>> number("x", "init_scale", 2**16), text("x", "dtype", "fp16", ("fp16", "bf16")), flag("x", "enabled", True)
(65536.0, 'fp16', True)
>>> number("x", "init_scale", "big")
Traceback (most recent call last):
unimp.errors.PolicyError: x: init_scale: expected a number, got a string 'big'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from unimp.dtypes import FLT_MAX
from unimp.errors import PolicyError, UnsupportedError
from unimp.policy.spec import short, show
from unimp.text import printable

MAX_BITS = 1000  # bits of an integer a source may hold (any larger is out of every dtype's range)
MAX_NAME = 80  # characters of a source key quoted in a message or comment


class Name(str):
    """A name in pasted code (``torch.float16``, ``optimizer``), kept as its text."""

    __slots__ = ()


def name(key: Any) -> str:
    """A source key (or location) as quoted in a message or comment: escaped, at most ``MAX_NAME`` characters."""
    text = key if isinstance(key, str) else show(key)
    text = printable(text[:MAX_NAME * 2])
    return text if len(text) <= MAX_NAME else text[:MAX_NAME] + "..."


def refuse(source: str, key: str, message: str, fix: str) -> UnsupportedError:
    """What the source says that unimp cannot express: names the source key and the fix."""
    return UnsupportedError(f"{printable(source)}: {name(key) + ': ' if key else ''}{message}; {fix}")


def bad(source: str, key: str, message: str) -> PolicyError:
    """Malformed source input: names the source (file or ``<argument>``) and the key."""
    return PolicyError(f"{printable(source)}: {name(key) + ': ' if key else ''}{message}")


def check_keys(given: Mapping[str, Any], known: Mapping[str, Any] | tuple[str, ...], source: str,
               where: str = "") -> None:
    """Refuse keys the source system does not have (a typo would otherwise be dropped)."""
    from unimp.policy.ops import suggest

    for key in given:
        if key not in known:
            h = suggest(key, list(known)) if isinstance(key, str) else None
            tail = f"did you mean '{h}'?" if h else f"known: {', '.join(known)}"
            raise bad(source, f"{where}{key}", f"unknown argument ({tail})")


def number(source: str, key: str, value: Any, kind: type = float, minimum: float | None = None) -> Any:
    """A numeric source value checked for type (``kind`` int or float), range and lower bound."""
    if isinstance(value, Name):
        raise bad(source, key, f"`{name(str(value))}` is a name in the code, not a value; write the number it "
                               f"holds")
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise bad(source, key, f"{show(value)} is out of range (at most {FLT_MAX:.4g}); write the value the "
                               f"system runs")
    if kind is int:
        ok = ok and math.isfinite(value) and float(value).is_integer()
    if not ok or (isinstance(value, float) and math.isnan(value)):
        word = "an integer" if kind is int else "a number"
        raise bad(source, key, f"expected {word}, got {show(value)}")
    if minimum is not None and value < minimum:
        raise bad(source, key, f"must be >= {minimum:g}; got {show(value)}")
    return int(value) if kind is int else float(value)


def text(source: str, key: str, value: Any, choices: Any = None) -> str:
    """A string source value, checked for type (and against ``choices`` when given), never quoted whole.

    >>> text("x", "dtype", "fp16", ("fp16", "bf16"))
    'fp16'
    """
    if not isinstance(value, str):
        raise bad(source, key, f"expected a string, got {show(value)}")
    if isinstance(value, Name) and (choices is None or value not in choices):
        raise bad(source, key, f"`{name(str(value))}` is a name in the code, not a value; write the value it holds"
                  + (f" ({', '.join(map(str, choices))})" if choices else ""))
    if choices is not None and value not in choices:
        raise bad(source, key, f"{short(value)} is not one of {', '.join(map(str, choices))}")
    return value


def flag(source: str, key: str, value: Any) -> bool:
    if isinstance(value, Name):
        raise bad(source, key, f"`{name(str(value))}` is a name in the code, not a value; write True or False")
    if not isinstance(value, bool):
        raise bad(source, key, f"expected true or false, got {show(value)}")
    return value


def power_of_two(x: float) -> int | None:
    """``k`` when ``x == 2**k`` exactly, else None."""
    m, e = math.frexp(x)
    return e - 1 if m == 0.5 else None
