"""unimp backend for PaddlePaddle: dygraph ``paddle.nn.Layer`` and legacy static ``Program``.

Importing this package does not import paddle; the backend does so when it is used.

>>> import unimp_paddle
>>> unimp_paddle.PaddleBackend.name
'paddle'
"""

from .backend import PaddleBackend

__all__ = ["PaddleBackend"]
