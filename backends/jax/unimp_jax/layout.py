"""Layout findings of a Flax model and the policy's action on them (``layout.on_misaligned``).

>>> import unimp
>>> act_on_findings([], unimp.load("mixed_bf16"))
"""

from __future__ import annotations

import warnings

from unimp.spi import Policy, UnimpWarning, UnsupportedError


def act_on_findings(findings: list[str], policy: Policy) -> None:
    """Misaligned dims: ignore, warn (UnimpWarning) or raise (UnsupportedError naming every path)."""
    if not findings or policy.layout.on_misaligned == "ignore":
        return
    text = "; ".join(findings)
    if policy.layout.on_misaligned == "error":
        raise UnsupportedError(f"policy {policy.name!r}: misaligned dims: {text}; fix: pad these dims to "
                               f"multiples of {policy.layout.align} or set layout.on_misaligned = 'warn'")
    warnings.warn(f"unimp: misaligned dims: {text}", UnimpWarning, stacklevel=4)
