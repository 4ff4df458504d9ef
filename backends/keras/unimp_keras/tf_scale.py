"""A float32 loss scale read and written through its bits on Keras' TensorFlow backend.

TensorFlow's CPU kernels flush float32 subnormals (inputs and cast results), so :mod:`unimp_keras.scaler` reads
(:func:`decode`) and writes (:func:`encode`) the held scale through ``tf.bitcast``: subnormal scales stay exact.

>>> import tensorflow as tf
>>> float(decode(encode(tf.constant(2.0 ** -140, tf.float64)))) == 2.0 ** -140
True
"""

from __future__ import annotations

import tensorflow as tf

from unimp.spi import dtypes

_TWO_149 = 2.0 ** 149


def decode(scale: tf.Tensor) -> tf.Tensor:
    """A float32 scale as float64, subnormals included (read from the bits)."""
    bits = tf.bitcast(tf.convert_to_tensor(scale, tf.float32), tf.int32)
    sub = tf.equal(tf.bitwise.bitwise_and(bits, 0x7F800000), 0)
    mantissa = tf.cast(tf.bitwise.bitwise_and(bits, 0x7FFFFF), tf.float64) / _TWO_149
    return tf.where(sub, mantissa, tf.cast(scale, tf.float64))


def encode(x: tf.Tensor) -> tf.Tensor:
    """A float64 value on the float32 grid as float32, subnormals built from their bits (a cast flushes them)."""
    sub = x < dtypes.FLT_TINY
    bits = tf.cast(tf.where(sub, x, tf.zeros_like(x)) * _TWO_149, tf.int32)
    tiny = tf.fill(tf.shape(x), tf.constant(dtypes.FLT_TINY, x.dtype))
    return tf.where(sub, tf.bitcast(bits, tf.float32), tf.cast(tf.where(sub, tiny, x), tf.float32))


def assert_not(error: tf.Tensor, message: str) -> None:
    """``at_min = "error"`` hit inside a (possibly traced) step: a ``tf.debugging.Assert``."""
    tf.debugging.Assert(tf.reduce_all(tf.logical_not(error)), [message])
