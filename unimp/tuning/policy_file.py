"""The tuned policy as a file people review: TOML with a comment on every override it adds.

The file ``extends`` the preset the policy is (when it is one) or holds the whole resolved policy, then
the added overrides (first, so they win), then the policy's own. :func:`render` checks that the text
loads back to the tuned policy's fingerprint: what is written is what was measured.

>>> import unimp
>>> base = unimp.load("fp8_tensorwise")
>>> keep = {"modules": ["embed"], "fp8": False}
>>> tuned = base.replace(name="demo", overrides=[keep])
>>> print(render(tuned, base, ["tuned by hand"], [(keep, ["embed: too sensitive"])], ["up: lowered"]))
# tuned by hand
name = "demo"
extends = "fp8_tensorwise"
<BLANKLINE>
# embed: too sensitive
[[overrides]]
modules = ["embed"]
fp8 = false
<BLANKLINE>
# up: lowered
<BLANKLINE>
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from unimp.errors import PolicyError
from unimp.policy import Policy
from unimp.policy.loading import load, preset_names
from unimp.policy.resolve import parse_text, to_text
from unimp.policy.spec import OVERRIDE


def preset_of(policy: Policy) -> str | None:
    """The preset ``policy`` is (same fingerprint; its own name first), else None."""
    names = preset_names()
    for name in ([policy.name] if policy.name in names else []) + list(names):
        if load(name).fingerprint == policy.fingerprint:
            return name
    return None


def _value(value: Any) -> str:
    """A TOML value: a boolean, a string or a list of strings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(list(value) if isinstance(value, tuple) else value, ensure_ascii=False).replace(
        "\x7f", "\\u007f")


def _comment(text: str) -> str:
    from unimp.text import printable

    return f"# {printable(text)}"


def _override(table: dict[str, Any], comments: Sequence[str]) -> list[str]:
    """One ``[[overrides]]`` table: its comment above it, or one comment per module when it lists several."""
    keys = [f"{k} = {_value(table[k])}" for k in OVERRIDE if k in table and k != "modules"]
    if len(table["modules"]) == 1:
        return [*map(_comment, comments), "[[overrides]]", f"modules = {_value(table['modules'])}", *keys, ""]
    return ["[[overrides]]", "modules = [",
            *(f"    {_value(m)},  {_comment(c)}" for m, c in zip(table["modules"], comments, strict=True)), "]",
            *keys, ""]


def render(tuned: Policy, base: Policy, header: Sequence[str], added: Sequence[tuple[dict[str, Any], Sequence[str]]],
           tail: Sequence[str] = ()) -> str:
    """The file of ``tuned``: ``base`` with the ``added`` overrides first (each with one comment per module it
    lists), ``header`` and ``tail`` comment lines around it. Raises when the text would not load back to
    ``tuned``."""
    lines = [_comment(h) for h in header]
    preset = preset_of(base)
    if preset is not None:
        lines += [f"name = {_value(tuned.name)}", f"extends = {_value(preset)}",
                  *([f"tuned_on = {_value(tuned.tuned_on)}"] if tuned.tuned_on else []), ""]
    else:
        body = {k: v for k, v in tuned.to_dict().items() if k != "overrides"}
        lines += [to_text(body, "toml").rstrip("\n"), ""]
    for table, comments in added:
        lines += _override(table, comments)
    if base.overrides:
        lines.append(_comment(f"the overrides of policy {base.name!r}" + ("" if preset else f" ({base.source})")))
        for o in base.overrides:
            lines += _override({k: v for k, v in vars(o).items() if v not in (None, ())}, ())
    lines += [_comment(t) for t in tail]
    text = "\n".join(lines) + "\n"
    try:
        again = load(parse_text(text, "toml"))
    except PolicyError as e:
        raise AssertionError(f"unimp bug: the tuned policy file does not load back ({e})") from None
    if again.fingerprint != tuned.fingerprint or again.tuned_on != tuned.tuned_on:
        raise AssertionError(f"unimp bug: the tuned policy file loads as {again.fingerprint}, not the tuned "
                             f"{tuned.fingerprint}")
    return text
