"""unimp-numpy: a minimal NumPy reference backend, the sixth framework of unimp.

It shows what a new framework's backend writes, and nothing more: a native op-name table
(:mod:`unimp_numpy.ops`), a Backend class that declares it with its capability tags
(:mod:`unimp_numpy.backend`), the Amp (:mod:`unimp_numpy.amp`) and the conformance kit
(:mod:`unimp_numpy.testing`). Its "framework" is :mod:`unimp_numpy.nn`, a few layers with a
hand-written backward pass. Everything it takes from the core comes from ``unimp.spi``.
"""
