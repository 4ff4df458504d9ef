"""The plug-in contract: a small :class:`Backend` class (:mod:`unimp.backend.adapter`) and the :class:`Amp`
handle it returns (:mod:`unimp.backend.amp`).

A third-party backend subclasses both and registers the Backend under the entry-point group
``unimp.backends``. The module the entry point names must not import its framework at import
time (detection only looks at frameworks already in ``sys.modules``).

>>> issubclass(Amp, object) and Backend.priority
0
"""

from unimp.backend.adapter import TAGS, Backend
from unimp.backend.amp import STATE_FORMAT, Amp, NoForwardError
from unimp.errors import UnimpWarning

__all__ = ["STATE_FORMAT", "TAGS", "Amp", "Backend", "NoForwardError", "UnimpWarning"]
