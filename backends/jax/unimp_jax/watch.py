"""``amp.watch()`` for JAX (nnx and linen), pure: the statistics come back from the jitted step.

``amp.value_and_grad(loss_fn, numerics=True)`` (while a watch runs) returns a fourth value,
``numerics``: a small pytree of arrays computed inside your jitted step, which you hand back with
``amp.record(numerics)`` after it. No host callback runs in the step, and ``amp.record`` reads the
previous step's numerics (done by then: no wait) and only on a step that is sampled or skipped
more than its two flags.

Inside the step, while the loss is traced, every layer call (:func:`unimp_jax.layers.run_layer`)
passes its output (and, with ``localize``, each input) through :func:`_tap`: an identity whose
backward measures the gradient into the gradient of a probe array differentiated with the model
(one row per layer tensor: the check sum, the largest finite magnitude and the class counts of
:data:`unimp.watch.records.AT_LEAST`, in the dtype of :func:`target`). The forward rows are measured
as the layers return. Whether a step is sampled comes from the loss-scale state's step counter, so
``jax.lax.cond`` runs the measurement on sampled steps only; parameter gradients are checked only
when the step is not finite. Positions: the forward's are the order the layers were traced in, the
backward's mirror them (:func:`unimp.watch.first_nonfinite`). A layer called inside a nested
transformation (``nnx.scan``, ``jax.checkpoint`` bodies) is not watched.

>>> import jax, jax.numpy as jnp, optax, unimp
>>> from flax import nnx
>>> model = nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 1, rngs=nnx.Rngs(1)))
>>> amp = unimp.apply("mixed_bf16", model, optax.sgd(0.1))
>>> watch = amp.watch(every=2)
>>> grad_fn = amp.value_and_grad(lambda m, x: m(x).astype(jnp.float32).mean(), numerics=True)
>>> @nnx.jit
... def step(model, optimizer, x):
...     loss, grads, finite, numerics = grad_fn(optimizer, model, x)
...     optimizer.update(model, grads)
...     return loss, numerics
>>> for _ in range(3):
...     amp.record(step(amp.model, amp.optimizer, jnp.ones((4, 8)))[1])
>>> watch.close()
>>> [r["step"] for r in watch.records], watch.records[0]["layers"][0]["path"]
([0, 2], 'layers.0')
>>> _ = amp.remove()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from unimp.spi import UnsupportedError, dtypes

IN, OUT, GRAD_OUT, GRAD_IN, FP8_IN, FP8_GRAD_OUT = range(6)
PLACES = ("input", "output", "grad_output", "grad_input", "fp8_input", "fp8_grad_output")
CODES = ("float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")
# a row: the check sum, amax, the six AT_LEAST counts, numel, how many calls wrote it, dtype code x that
ROW, NUMEL, OCCURRED, CODE = 11, 8, 9, 10
_INT = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}
_ACTIVE: list[Collector] = []  # the collector of the watched loss being traced (trace time only)


def collector() -> Collector | None:
    """The collector of the watched loss being traced at this level, else None."""
    if not _ACTIVE or not _ACTIVE[-1].here():
        return None
    return _ACTIVE[-1]


@functools.cache
def _bounds(dtype: str, target: str) -> tuple[int, ...]:
    """Bit patterns of ``dtype``'s magnitudes where a cast to ``target`` changes class (as unimp_torch's):
    above zero, above ``underflow_at``, at or above ``normal_from`` and ``overflow_at``, +inf, the first NaN."""
    lim = dtypes.limits(target)
    dt = jnp.dtype(dtype)  # a NumPy dtype (ml_dtypes for bfloat16): host work, not traced
    itype = np.dtype(_INT[dt.itemsize])

    def pattern(value: float, up: bool) -> int:
        with np.errstate(over="ignore"):  # a value past the format's max is meant to round to inf here
            p = int(np.asarray(value, np.float64).astype(dt).view(itype))
        got = float(np.asarray(p, itype).view(dt).astype(np.float64))
        return p + 1 if up and got < value else p - 1 if not up and got > value else p

    inf = pattern(float("inf"), True)
    return (1, pattern(lim.underflow_at, False) + 1, pattern(lim.normal_from, True),
            min(pattern(lim.overflow_at, True), inf), inf, inf + 1)


def _row(x: jax.Array, measure: tuple | None, sampled: jax.Array, check: bool) -> jax.Array:
    """One row for ``x`` (see :data:`ROW`): the sum when ``check``, the measurement on sampled steps."""
    total = jnp.sum(x, dtype=jnp.float32) if check else jnp.zeros((), jnp.float32)
    if measure is None:
        return jnp.zeros(ROW, jnp.float32).at[0].set(total).at[OCCURRED].set(1.0)
    target, scale_to = measure

    def measured(x: jax.Array) -> jax.Array:
        a = jnp.abs(x)
        a = a.astype(jnp.float32) if scale_to is not None or a.dtype.itemsize > 4 else a
        amax = jnp.max(jnp.nan_to_num(a, nan=0.0, posinf=0.0)).astype(jnp.float32)
        if scale_to is not None:  # tensorwise to the format's max, as an FP8 cast scales
            a = a * jnp.where(amax > 0, scale_to / amax, 1.0)
        itype = _INT[a.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(a, itype) & jnp.iinfo(itype).max  # magnitudes' patterns, in order
        counts = [jnp.sum(bits >= b, dtype=jnp.float32) for b in _bounds(a.dtype.name, target)]
        return jnp.stack([total, amax, *counts, jnp.float32(a.size), jnp.float32(1.0),
                          jnp.float32(CODES.index(target))])

    def unmeasured(x: jax.Array) -> jax.Array:
        return jnp.zeros(ROW, jnp.float32).at[0].set(total).at[OCCURRED].set(1.0)

    return jax.lax.cond(sampled, measured, unmeasured, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tap(x: jax.Array, probe: jax.Array, sampled: jax.Array, spec: tuple) -> jax.Array:
    """``x``; its backward writes the gradient's row(s) into the probe's cotangent (``spec``: the slot, the
    measurement (target dtype, FP8 max) or None, whether to check every step, an FP8 row or None)."""
    return x


def _tap_fwd(x: jax.Array, probe: jax.Array, sampled: jax.Array, spec: tuple) -> tuple[jax.Array, Any]:
    return x, (sampled, probe.shape)


def _tap_bwd(spec: tuple, res: Any, grad: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    (sampled, shape), (slot, measure, check, fp8) = res, spec
    rows = jnp.zeros(shape, jnp.float32).at[slot].set(_row(grad, measure, sampled, check))
    if fp8 is not None:
        rows = rows.at[fp8[0]].set(_row(grad, fp8[1], sampled, False))
    return grad, rows, None


_tap.defvjp(_tap_fwd, _tap_bwd)


class Collector:
    """What one traced watched loss collects: the forward rows of the layers it calls, in call order."""

    def __init__(self, watch: JaxWatch, probe: jax.Array, sampled: jax.Array) -> None:
        self.watch, self.probe, self.sampled = watch, probe, sampled
        self.rows: list[jax.Array] = []
        self.slots: list[int] = []  # the slot of each forward row, in trace order
        self.trace = _current_trace()

    def here(self) -> bool:
        """Whether the layer being traced is at this collector's level (not inside a nested transformation)."""
        return self.trace is None or _current_trace() is self.trace

    def _floating(self, leaves: list[Any]) -> list[int]:
        return [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
                and x.size]

    def enter(self, path: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A layer's inputs: checked (``localize``) and, with ``localize``, tapped for their gradients."""
        base = self.watch.base(path)
        if base is None or not self.watch.localize:
            return args, kwargs
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        floating = self._floating(leaves)
        if not floating:
            return args, kwargs
        self.rows.append(sum(_row(leaves[i], None, self.sampled, True) for i in floating))
        self.slots.append(base + IN)
        for i in floating:
            leaves[i] = _tap(leaves[i], self.probe, self.sampled, (base + GRAD_IN, None, True, None))
        return jax.tree_util.tree_unflatten(tree, leaves)

    def leave(self, path: str, inputs: tuple, out: Any, compute: str | None) -> Any:
        """A layer's output: measured (sampled steps), checked (``localize``), tapped for its gradient
        (``compute``: the dtype the layer computed in)."""
        base = self.watch.base(path)
        if base is None:
            return out
        leaves, tree = jax.tree_util.tree_flatten(out)
        floating = self._floating(leaves)
        if not floating:
            return out
        main = leaves[floating[0]]
        target = self.watch.target(main.dtype, compute)
        self.rows.append(_row(main, (target, None), self.sampled, self.watch.localize))
        self.slots.append(base + OUT)
        fp8 = self.watch.fp8_formats.get(path)
        if fp8 is not None:
            x = next((leaf for leaf in jax.tree_util.tree_leaves(inputs)
                      if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)), None)
            if x is not None:
                self.rows.append(_row(x, (fp8[0], float(dtypes.limits(fp8[0]).max)), self.sampled, False))
                self.slots.append(base + FP8_IN)
        fp8_row = ((base + FP8_GRAD_OUT, (fp8[1], float(dtypes.limits(fp8[1]).max))) if fp8 is not None else None)
        leaves[floating[0]] = _tap(main, self.probe, self.sampled,
                                   (base + GRAD_OUT, (target, None), self.watch.localize, fp8_row))
        return jax.tree_util.tree_unflatten(tree, leaves)

    def forward(self) -> jax.Array:
        """The forward rows, stacked in call order."""
        return jnp.stack(self.rows) if self.rows else jnp.zeros((0, ROW), jnp.float32)


def _current_trace() -> Any:
    try:
        from jax._src import core

        return core.trace_ctx.trace
    except (ImportError, AttributeError):  # pragma: no cover - another JAX: no nested-transformation guard
        return None


class JaxWatch:
    """The JAX side of one :class:`unimp.watch.Watch` on one JAX Amp."""

    def __init__(self, amp: Any, session: Any) -> None:
        self.amp, self.session = amp, session
        self.localize = session.localize
        self.paths = [row.path for row in amp.plan.layers]
        self._base = {p: 6 * i for i, p in enumerate(self.paths)}
        self.slots = 6 * len(self.paths)
        self.fp8_formats = {path: tuple(dtypes.FP8_FORMATS[f] for f in lp.fp8_formats)
                            for path, lp in amp.layers.items() if lp.fp8 and len(lp.fp8_formats) == 2}
        self.start = amp.loss_scale_state().steps
        self.forward_slots: tuple[int, ...] = ()  # the slots of the forward rows, as the step was traced
        self.param_paths: tuple[str, ...] = ()  # the layer of each parameter-gradient check
        self.pending: Any = None  # the last step's numerics, read at the next record (done by then)
        self.backward_order: list[str] = []  # set when a watched step is traced

    def base(self, path: str) -> int | None:
        return self._base.get(path)

    @staticmethod
    def target(dtype: Any, compute: str | None) -> str:
        """The dtype a tensor is measured in: its layer's compute dtype where it is wider (a float32 output of
        a layer that computed in float16), else its own."""
        own = jnp.dtype(dtype)
        return compute if compute in ("float16", "bfloat16") and own.itemsize > 2 else own.name

    # ------------------------------------------------------------------ in the traced step
    def sampled(self, steps: jax.Array) -> jax.Array:
        every = self.session.every
        return (steps >= self.start) & (jnp.mod(steps - self.start, every) == 0)

    @contextlib.contextmanager
    def collecting(self, probe: jax.Array, sampled: jax.Array) -> Iterator[Collector]:
        col = Collector(self, probe, sampled)
        _ACTIVE.append(col)
        try:
            yield col
        finally:
            _ACTIVE.pop()

    def numerics(self, slots: list[int], forward: jax.Array, probe_grad: jax.Array, params: list[tuple[Any, Any]],
                 finite: jax.Array, loss: jax.Array, scale: Any, steps: jax.Array,
                 sampled: jax.Array) -> dict[str, jax.Array]:
        """The step's numerics pytree (what ``amp.record`` takes): ``forward``, the rows of the layers in
        ``slots`` (as the loss returned them), ``probe_grad`` the backward's rows, ``params`` the parameter
        gradients with their key paths (checked only when the step is not finite)."""
        self.forward_slots = tuple(slots)
        self.param_paths = tuple(_layer_path(path) for path, _ in params)
        returns = [self.paths[s // 6] for s in slots if s % 6 == OUT]
        self.backward_order = list(reversed(returns))  # gradients arrive in the reverse order of the returns
        leaves = [leaf for _, leaf in params]

        def sums(leaves: list[jax.Array]) -> jax.Array:
            return jnp.stack([jnp.sum(g, dtype=jnp.float32) for g in leaves]) if leaves else jnp.zeros(0)

        params = jax.lax.cond(finite, lambda ls: jnp.zeros(len(ls), jnp.float32), sums, leaves)
        scale = jnp.float32(1.0) if scale is None else jnp.asarray(scale, jnp.float32)
        return {"step": steps, "sampled": sampled, "finite": finite, "scale": scale,
                "loss": jnp.asarray(loss, jnp.float32) * scale, "forward": forward,
                "backward": probe_grad, "params": params}

    # ------------------------------------------------------------------ on the host
    def record(self, numerics: Any) -> None:
        """Keep this step's numerics; read the previous step's (sampled or skipped: recorded)."""
        previous, self.pending = self.pending, numerics
        if previous is not None:
            self._read(previous)

    def flush(self) -> None:
        previous, self.pending = self.pending, None
        if previous is not None:
            self._read(previous)

    def _read(self, numerics: Any) -> None:
        sampled, finite = (bool(v) for v in jax.device_get((numerics["sampled"], numerics["finite"])))
        skipped = not finite and self.amp.plan.loss_scale.skip_nonfinite
        if not (sampled or skipped):
            return
        n = jax.device_get(numerics)
        forward, backward = np.asarray(n["forward"]), np.asarray(n["backward"])
        if len(forward) != len(self.forward_slots):
            raise UnsupportedError(f"amp.record(): these numerics have {len(forward)} forward rows, the step last "
                                   f"traced {len(self.forward_slots)}; record the numerics of the step "
                                   f"amp.value_and_grad(..., numerics=True) returned")
        rows = {slot: forward[i] for i, slot in enumerate(self.forward_slots)}
        rows.update({slot: backward[slot] for slot in range(len(backward)) if backward[slot][OCCURRED] > 0})
        position = {slot: float(i) for i, slot in enumerate(self.forward_slots)}
        events, layers = [], []
        for slot, row in rows.items():
            path, place = self.paths[slot // 6], PLACES[slot % 6]
            measured = row[NUMEL] > 0
            if place in ("input", "output", "grad_output", "grad_input") and (self.localize or measured):
                events.append((path, place, position.get(slot), bool(np.isfinite(row[0])) and not (
                    measured and row[2 + 4] > 0)))
            if measured:
                code = CODES[round(row[CODE] / row[OCCURRED])]
                layers.append((path, place, code, float(row[1]), [int(c) for c in row[2:NUMEL + 1]]))
        if skipped:
            events.append(("<loss>", "loss", None, bool(np.isfinite(n["loss"]))))
            events += [(p, "grad_param", None, bool(np.isfinite(s))) for p, s in zip(self.param_paths, n["params"],
                                                                                     strict=True)]
        # in execution order: the forward as the layers returned, the backward in the reverse order
        layers.sort(key=lambda s: (s[1] in ("grad_output", "fp8_grad_output"),
                                   position.get(self._base[s[0]] + OUT, 0.0)
                                   * (-1 if s[1] in ("grad_output", "fp8_grad_output") else 1)))
        self.session.add(int(n["step"]), skipped=skipped, scale=float(n["scale"]), sampled=sampled,
                         layers=layers, events=events, backward_order=self.backward_order)

    def close(self) -> None:
        self.flush()
        if self.amp._watching is self:
            self.amp._watching = None


def _layer_path(key_path: tuple) -> str:
    """The layer owning a parameter, from its key path in a gradient tree (nnx State or linen params)."""
    keys = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in key_path]
    keys = [k for k in keys if k not in ("value", "raw_value")]
    if keys and keys[0] == "params":
        keys = keys[1:]
    return ".".join(keys[:-1])


def start(amp: Any, session: Any) -> JaxWatch:
    """``amp.watch(...)``: a :class:`JaxWatch` for ``session``; steps come through ``amp.record``."""
    watch = JaxWatch(amp, session)
    session.bind(watch.start, watch.close)
    amp._watching = watch
    return watch
