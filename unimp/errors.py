"""The errors unimp raises for bad input.

>>> from unimp.errors import PolicyError
>>> issubclass(PolicyError, ValueError)
True
"""

from __future__ import annotations


class PolicyError(ValueError):
    """A policy that cannot be loaded: names the source, the key path and the fix.

    ``problems`` holds one ``"source: key.path: message"`` line per problem found.
    """

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class UnsupportedError(RuntimeError):
    """A request a backend, the framework or the hardware cannot honour (names the fix)."""


class TuneError(ValueError):
    """Bad arguments to :func:`unimp.sensitivity` / :func:`unimp.tune` (or ``unimp tune``): names the
    argument and the fix."""


class UnimpWarning(UserWarning):
    """Warnings about precision (slow dtype on this hardware, misaligned dims, fallbacks, risky knobs)."""


class StateError(ValueError):
    """A ``state_dict`` that does not belong to this policy or has the wrong keys."""


class AlreadyAppliedError(RuntimeError):
    """``unimp.apply`` on a model that has a policy applied, or is being applied or removed in another
    thread (names the model and the fix: ``amp.remove()`` first, or keep the Amp)."""
