"""unimp backend for Intel CPUs (``pip install unimp-ipex[ipex]``).

>>> import unimp_ipex
>>> unimp_ipex.IpexBackend.name
'ipex'

Importing this package imports neither torch nor IPEX (IPEX patches torch process-wide and
takes seconds to import); the modules that need them import them lazily.
"""

__all__ = ["IpexBackend"]


def __getattr__(name: str):
    if name == "IpexBackend":
        from .backend import IpexBackend

        return IpexBackend
    raise AttributeError(name)
