"""Text a user supplied (a module path, a file name, a source key) made safe to print.

One helper for every place unimp prints such a name: reports, errors, warnings, watch summaries,
comments in written policy files. A terminal never receives a control sequence from a name
(``model.add_module("b\\x1b[2J", ...)`` prints ``b\\x1b[2J``, it does not clear the screen).

>>> print(printable("a\\x1b[31mb\\ncd\\udc80"))
a\\x1b[31mb\\ncd\\udc80
>>> print(printable_lines("two\\nlines\\x07"))
two
lines\\x07
"""

from __future__ import annotations


def printable(text: str) -> str:
    r"""``text`` safe for a terminal and a TOML comment: control characters (newlines included),
    escape sequences and lone surrogates escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def printable_lines(text: str) -> str:
    """``text`` with each line :func:`printable` (its own line breaks kept: a multi-line message)."""
    if text.isprintable():
        return text
    return "\n".join(printable(line) for line in text.split("\n"))
