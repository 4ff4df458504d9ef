"""What ran in one real forward: the report rows, recorded while the forward is traced.

``amp.report(x)`` traces one forward abstractly (``nnx.eval_shape`` / ``jax.eval_shape``) under
:func:`recording`; each layer call run by :func:`unimp_jax.layers.run_layer` adds its row (compute,
param and output dtypes as traced, the FP8 recipe). Under ``nnx.jit`` layer code runs only while a
step is traced, so an nnx model remembers the last forward's input shapes per static token
(:func:`remember_inputs`) for ``amp.report()`` without arguments.

>>> from unimp_jax.layers import LayerPlan
>>> with recording() as rows:
...     record(LayerPlan("fc", "linear", ("Linear",), None), "bfloat16", "float32", "bfloat16")
>>> rows["fc"].compute_dtype, rows["fc"].output_dtype
('bfloat16', 'bfloat16')
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from unimp.spi import Fp8Decision, Report, ReportRow

# the recordings open in each thread (a report traced in one thread never takes another thread's layer calls)
_local = threading.local()
# The last forward's input shapes per static token (model class + policy fingerprint). Keyed by the
# token, not by the model: a compiled step traced for an equal token is reused by every Amp with that
# token. It holds ShapeDtypeStructs only (no arrays, no model).
_LAST_INPUTS: dict[str, Any] = {}


@contextlib.contextmanager
def recording() -> Iterator[dict[str, ReportRow]]:
    """The rows of the layer calls made inside (path -> row, in call order)."""
    rows: dict[str, ReportRow] = {}
    previous = getattr(_local, "rows", None)
    _local.rows = rows
    try:
        yield rows
    finally:
        _local.rows = previous


def record(lp: Any, compute_dtype: str | None, param_dtype: str | None, output_dtype: str | None) -> None:
    """One layer call (``lp``: its :class:`~unimp_jax.layers.LayerPlan`), when a forward is recorded."""
    rows = getattr(_local, "rows", None)
    if rows is not None:
        rows[lp.path] = ReportRow(lp.path, lp.kind, compute_dtype, param_dtype, output_dtype, fp8=lp.fp8)


def remember_inputs(token: str, args: tuple, kwargs: dict) -> None:
    import jax

    _LAST_INPUTS[token] = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, (args, kwargs))


def last_inputs(token: str) -> tuple[tuple, dict] | None:
    return _LAST_INPUTS.get(token)


def report(amp: Any, forward: Callable[[], Any]) -> Report:
    """``amp``'s report of the layer calls ``forward()`` traces."""
    with recording() as rows:
        forward()
    return amp.report_header(list(rows.values()),
                             notes=[*amp.plan.notes, *Fp8Decision.report_notes(amp.fp8_decisions)])
