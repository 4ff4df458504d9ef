"""The errors unimp raises for bad input.

Every message is printable (:func:`unimp.text.printable_lines`): a name it quotes -- a module path, a
file name, a source key -- cannot put a control sequence on the user's terminal.

>>> from unimp.errors import PolicyError, UnsupportedError
>>> issubclass(PolicyError, ValueError)
True
>>> str(UnsupportedError("layer 'b\\x1b[2J': no FP8"))
"layer 'b\\\\x1b[2J': no FP8"
"""

from __future__ import annotations

from typing import Any

from unimp.text import printable_lines


def _escaped(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(printable_lines(a) if isinstance(a, str) else a for a in args)


class _Printable:
    """Escapes its message's control characters (its line breaks kept)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*_escaped(args))


class PolicyError(_Printable, ValueError):
    """A policy that cannot be loaded: names the source, the key path and the fix.

    ``problems`` holds one ``"source: key.path: message"`` line per problem found.
    """

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [printable_lines(p) for p in ([problems] if isinstance(problems, str) else problems)]
        super().__init__("\n".join(self.problems))


class UnsupportedError(_Printable, RuntimeError):
    """A request a backend, the framework or the hardware cannot honour (names the fix)."""


class TuneError(_Printable, ValueError):
    """Bad arguments to :func:`unimp.sensitivity` / :func:`unimp.tune` (or ``unimp tune``): names the
    argument and the fix."""


class FileError(_Printable, ValueError, OSError):
    """A file unimp cannot write (or a target that is not a regular file): names the file, the cause
    and the fix. Whatever failed, nothing was left behind (:mod:`unimp.files`). Also an ``OSError``
    (what failed is the file system) and a ``ValueError`` (a bad path argument)."""


class UnimpWarning(_Printable, UserWarning):
    """Warnings about precision (slow dtype on this hardware, misaligned dims, fallbacks, risky knobs)."""


class StateError(_Printable, ValueError):
    """A ``state_dict`` that does not belong to this policy or has the wrong keys."""


class AlreadyAppliedError(RuntimeError):
    """``unimp.apply`` on a model that has a policy applied, or is being applied or removed in another
    thread (names the model and the fix: ``amp.remove()`` first, or keep the Amp)."""
