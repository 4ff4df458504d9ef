"""What an importer builds and returns: the commented policy :class:`Draft` (each key with the source key it
came from), the :class:`Imported` policy file, checked to load back to the policy reported, and the
:class:`Exported` native configuration.

>>> d = Draft("torch", "GradScaler", extends="torch_autocast_cuda", why="torch.amp.GradScaler")
>>> d.set("loss_scale.growth_interval", 100, "growth_interval")
>>> print(d.build().text.splitlines()[-1])
growth_interval = 100  # growth_interval
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from unimp.errors import PolicyError, UnimpWarning, UnsupportedError
from unimp.migrate.values import flag, number
from unimp.policy import Policy
from unimp.policy.loading import load, preset_names
from unimp.policy.spec import TABLES, short
from unimp.text import printable


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


def relabel(imp: Imported, system: str, source: str, why: str, ignored: tuple[str, ...] = (),
            notes: tuple[str, ...] = ()) -> Imported:
    """``imp`` (read by another system's importer, e.g. the DeepSpeed config an Accelerate file
    builds) as ``system``'s import: its title, its name line (``why``: how that config came about),
    ``notes`` added to its header, and every ignored key -- its own and ``ignored`` -- listed in the
    file, so nothing the user's source held is dropped from what they read."""
    lines = imp.text.splitlines()
    body = next(i for i, line in enumerate(lines) if line.startswith("name = "))
    kept = [line for line in lines[1:body] if not line.startswith("# Not precision settings (ignored): ")]
    every = tuple(dict.fromkeys((*imp.ignored, *ignored)))
    head = [f"# Imported from {system} ({printable(short(source))}) by `unimp import`.", *kept,
            *(f"# {printable(n)}" for n in notes)]
    if every:
        head.append(f"# Not precision settings (ignored): {printable(', '.join(every))}")
    name = f'name = "imported-{system}"  # unimp import --from {system}: {printable(why)}'
    return Imported(system, imp.policy, "\n".join([*head, name, *lines[body + 1:]]) + "\n", every)


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
    changed: tuple[str, ...] = ()  # with ``into``: the top-level keys of the user's file the export changed

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
        return checked(Imported(self.system, policy, self.render(), tuple(self.ignored)))

    def _locate(self, problem: str) -> str:
        """A load problem (``<dict>: loss_scale.min: ...``) restated with the source key."""
        text = problem.removeprefix("<dict>: ")
        for path, (_, origin) in self.keys.items():
            if text.startswith(path + ":") or text.startswith(path + "["):
                return f"{self.source}: {origin}: {text[len(path) + 1:].strip()} (unimp key {path})"
        return f"{self.source}: {text}"

    def render(self) -> str:
        """The policy file: every comment escaped (a source key cannot add a line or a control character)."""
        lines = [f"# Imported from {self.system} ({printable(short(self.source))}) by `unimp import`.",
                 *(f"# {printable(n)}" for n in self.notes)]
        if self.ignored:
            lines.append(f"# Not precision settings (ignored): {printable(', '.join(self.ignored))}")
        lines += [f'name = "imported-{self.system}"  # unimp import --from {self.system}',
                  f'extends = "{self.extends}"  # {printable(self.why)}']
        tables: dict[str, list[str]] = {}
        for path, (value, origin) in self.keys.items():
            table, _, key = path.rpartition(".")
            line = f"{key} = {toml_value(value)}  # {printable(origin)}"
            if table:
                tables.setdefault(table, []).append(line)
            else:
                lines.append(line)
        for table, rows in tables.items():
            lines += ["", f"[{table}]", *rows]
        return "\n".join(lines) + "\n"


def checked(imported: Imported) -> Imported:
    """``imported``, once its text loads back to its policy's fingerprint (what is written is what was
    reported); a mismatch is an error, never a different file."""
    from unimp.policy.resolve import parse_text

    try:
        again = load(parse_text(imported.text, "toml"))
    except PolicyError as e:
        raise PolicyError(f"{imported.system}: the policy file does not load back ({e}); nothing written. "
                          f"This is a unimp bug: please report it with the configuration") from None
    if again.fingerprint != imported.policy.fingerprint:
        raise PolicyError(f"{imported.system}: the policy file loads as fingerprint {again.fingerprint}, not the "
                          f"{imported.policy.fingerprint} read; nothing written. This is a unimp bug: please report "
                          f"it with the configuration")
    return imported


def toml_value(value: Any) -> str:
    """One TOML value (inf written ``inf``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "inf" if math.isinf(value) and value > 0 else repr(value)
    return json.dumps(list(value) if isinstance(value, tuple) else value)


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
