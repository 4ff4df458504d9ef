"""``amp.watch()`` for Keras 3 (TensorFlow, JAX, torch): per-layer numerics measured inside Keras' own
compiled ``train_step`` (``fit``, ``train_on_batch``), and where a skipped step's first non-finite value
appeared. The records and writers are the core's (:class:`unimp.watch.Watch`), how a traced step's measurements
fold is :mod:`unimp.watch.traced`'s; this module taps.

While watched, the model builds three train functions from its ``train_step``: as Keras builds it, with taps
that only check finiteness (a float32 sum per tensor, for ``localize``) and with taps that measure; the host
picks one before each step (an unsampled step only returns three of the loss scaler's scalars beside its logs).
The taps sit in each report layer's ``call``: its output (with ``localize`` also its first input) in the
forward, and an identity measuring the gradient arriving at it (``tf.custom_gradient``, ``jax.custom_vjp``, a
torch tensor hook). A measurement (largest finite magnitude, the class counts of
:data:`unimp.watch.records.AT_LEAST`) is counted on bit patterns and leaves the step through Keras variables on
TensorFlow, ``jax.debug.callback`` on JAX, a list on torch. The taps change no value. A skipped step that was
not sampled is recorded with a note (``localize=True`` taps every step).

>>> import keras, numpy as np, unimp
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="fc1"), keras.layers.Dense(1, name="fc2")])
>>> amp = unimp.apply("mixed_bf16", model, keras.optimizers.SGD(0.1))
>>> model.compile(optimizer=amp.optimizer, loss="mse")
>>> watch = amp.watch(every=2)
>>> _ = model.fit(np.ones((24, 4), "float32"), np.zeros((24, 1), "float32"), batch_size=8, verbose=0)
>>> [r["step"] for r in watch.records], [(s["path"], s["tensor"]) for s in watch.records[0]["layers"]][:2]
([0, 2], [('fc1', 'output'), ('fc2', 'output')])
>>> _ = amp.remove()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
from keras import ops

from unimp.spi import UnsupportedError
from unimp.watch.traced import Taps, measured_in, thresholds

from .bind import _decide, reset_compiled_functions
from .index import is_graph
from .trace import call_name, restore, set_method

PLAIN, CHECKED, MEASURED = MODES = range(3)  # a step's train function: untapped, finiteness only, measured
INFO = "unimp_watch"  # the key of the scaler's scalars in a step's logs (removed before Keras sees them)
NOT_LOCATED = ("this skipped step was not sampled, and the watch taps sampled steps only: amp.watch(localize=True) "
               "taps every step, so that a skipped step names the layer and pass of its first non-finite value")


def _is_float(t: Any) -> bool:
    return (ops.is_tensor(t) and keras.backend.is_float_dtype(keras.backend.standardize_dtype(t.dtype))
            and 0 not in tuple(d for d in t.shape if d is not None))


@functools.cache
def _bounds(target: str, compare: str) -> tuple[int, ...]:
    """The bit patterns of ``compare``'s magnitudes (monotonic in the value) from which a value counts in each
    class of :data:`~unimp.watch.records.AT_LEAST` in ``target``: the smallest above zero, the thresholds of
    :func:`unimp.watch.traced.thresholds`, +inf, the first NaN."""
    itype = np.int64 if compare == "float64" else np.int32
    patterns = [int(np.asarray(t, compare).view(itype)) for t in thresholds(target, compare)]
    return (1, *patterns, patterns[-1] + 1)


class Primitives:
    """The few array operations :func:`measure` is written in: ``keras.ops`` (TensorFlow and JAX, where they are
    traced and fused); :class:`TorchPrimitives` for Keras' eager torch, whose ``keras.ops`` wrappers cost an
    extra pass per elementwise op."""

    def bits(self, x: Any, compare: str, itype: str) -> Any:
        """The bit patterns of ``x``'s magnitudes in ``compare`` (the sign bit off: a NaN may keep it)."""
        return ops.bitwise_and(ops.view(ops.cast(x, compare), itype), np.iinfo(itype).max)

    def amax(self, bits: Any, below: int, compare: str) -> Any:
        """The largest magnitude whose pattern is below ``below`` (+inf: the largest finite), float32."""
        finite = ops.where(ops.less(bits, below), ops.view(bits, compare), ops.zeros((), compare))
        return ops.cast(ops.max(finite), "float32")

    def at_least(self, bits: Any, bound: int) -> Any:
        """How many patterns are ``>= bound``: ``(pattern - (bound - 1))`` clamped to [0, 1], summed (int32)."""
        return ops.sum(ops.clip(bits - (bound - 1), 0, 1))

    def stack(self, counts: list[Any], size: Any) -> Any:
        """``counts`` and the numel of ``size`` (None: 1, a check), int32."""
        n = ops.ones((), "int32") if size is None else ops.cast(ops.size(size), "int32")
        return ops.stack([*(ops.cast(c, "int32") for c in counts), n])

    def nonfinite_sum(self, x: Any) -> Any:
        """1 (int32) when the float32 sum of ``x`` is not finite (some value is not), else 0."""
        return ops.cast(ops.logical_not(ops.isfinite(ops.sum(ops.cast(x, "float32")))), "int32")

    def zero(self) -> Any:
        return ops.zeros((), "float32")


class TorchPrimitives(Primitives):
    def bits(self, x: Any, compare: str, itype: str) -> Any:
        import torch

        return x.to(getattr(torch, compare)).view(getattr(torch, itype)) & np.iinfo(itype).max

    def amax(self, bits: Any, below: int, compare: str) -> Any:
        import torch

        return torch.where(bits < below, bits.view(getattr(torch, compare)), 0.0).max().float()

    def at_least(self, bits: Any, bound: int) -> Any:
        import torch

        return (bits - (bound - 1)).clamp_(0, 1).sum(dtype=torch.int32)

    def stack(self, counts: list[Any], size: Any) -> Any:
        import torch

        n = 1 if size is None else size.numel()
        return torch.stack([*counts, torch.tensor(n, dtype=torch.int32, device=counts[0].device)])

    def nonfinite_sum(self, x: Any) -> Any:
        import torch

        return (~torch.isfinite(x.sum(dtype=torch.float32))).to(torch.int32)

    def zero(self) -> Any:
        import torch

        return torch.zeros(())


def measure(x: Any, target: str, prims: Primitives) -> tuple[Any, Any]:
    """The largest finite magnitude of ``x`` (float32) and its :data:`~unimp.watch.records.AT_LEAST` counts in
    ``target`` (int32, 7), traced or eager on any Keras backend: counted on the bit patterns of the magnitudes
    in float32 (float64 for a float64 tensor), in integer passes (no denormal flushing: TensorFlow's CPU
    kernels treat subnormal operands of a float comparison as zero)."""
    compare = "float64" if keras.backend.standardize_dtype(x.dtype) == "float64" else "float32"
    itype = "int64" if compare == "float64" else "int32"
    bits, bounds = prims.bits(x, compare, itype), _bounds(target, compare)
    return prims.amax(bits, bounds[-2], compare), prims.stack([prims.at_least(bits, b) for b in bounds], bits)


def check(x: Any, prims: Primitives) -> tuple[Any, Any]:
    """Whether ``x`` is finite, as :func:`measure`'s counts (its non-finite count 1 or 0; numel 1: checked): one
    float32 sum (non-finite iff some value is), for a tapped step that is not sampled (``localize``)."""
    bad = prims.nonfinite_sum(x)
    zero = bad * 0
    return prims.zero(), prims.stack([zero, zero, zero, zero, bad, zero], None)


# ---------------------------------------------------------------------- how a measurement leaves the step
class _Store:
    """Where the taps' measurements go on one Keras backend, and what the host reads back after a step."""

    PRIMS = Primitives()

    def __init__(self, taps: Taps, size: int) -> None:
        self.taps = taps
        self.pending: list[tuple[int, Any, Any]] = []
        self.full = True  # measure (a sampled step), else only check (localize), as the step is traced

    def measured(self, x: Any, target: str | None) -> tuple[Any, Any]:
        """:func:`measure` on a sampled step, else :func:`check` (and always for ``target=None``)."""
        return measure(x, target, self.PRIMS) if self.full and target is not None else check(x, self.PRIMS)

    def checked(self, index: int, x: Any, target: str | None, then: Any) -> Any:
        """``then`` (unchanged), once ``x`` is measured (``target``: in that dtype; None: checked) into tap
        ``index``."""
        self.pending.append((index, *self.measured(x, target)))
        return then

    def forward(self, index: int, x: Any, target: str) -> Any:
        """``x`` (unchanged), measured into tap ``index``."""
        return self.checked(index, x, target, x)

    def backward(self, index: int, x: Any, target: str) -> Any:
        """``x`` (unchanged), its gradient measured into tap ``index``."""
        raise NotImplementedError

    def collect(self) -> None:
        """Hand the step's measurements to the taps (after the step)."""
        pending, self.pending = self.pending, []
        for index, amax, counts in pending:
            self.taps.put(index, float(np.asarray(amax)), np.asarray(counts).tolist())


class _TorchStore(_Store):
    PRIMS = TorchPrimitives()

    def checked(self, index: int, x: Any, target: str | None, then: Any) -> Any:
        import torch

        with torch.no_grad():
            return super().checked(index, x.detach(), target, then)

    def backward(self, index: int, x: Any, target: str) -> Any:
        if x.requires_grad:
            x.register_hook(lambda grad: self.checked(index, grad, target, None))
        return x


class _JaxStore(_Store):
    def checked(self, index: int, x: Any, target: str | None, then: Any) -> Any:
        import jax

        jax.debug.callback(functools.partial(self._put, index), *self.measured(x, target))
        return then

    def _put(self, index: int, amax: Any, counts: Any) -> None:
        self.pending.append((index, amax, counts))

    def backward(self, index: int, x: Any, target: str) -> Any:
        return _jax_tap_fn()(x, (self, index, target))

    def collect(self) -> None:
        import jax

        jax.effects_barrier()  # the step's callbacks have run
        super().collect()


@functools.cache
def _jax_tap_fn() -> Callable[..., Any]:
    import jax

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def tap(x: Any, spec: tuple) -> Any:
        return x

    def fwd(x: Any, spec: tuple) -> tuple[Any, None]:
        return x, None

    def bwd(spec: tuple, _: None, grad: Any) -> tuple[Any]:
        store, index, target = spec
        return (store.checked(index, grad, target, grad),)

    tap.defvjp(fwd, bwd)
    return tap


class _TfStore(_Store):
    """Keras variables the graph assigns the measurements to (a ``tf.function`` compiled by XLA runs no host
    code): per tap the largest amax and the summed counts; the host reads and zeroes them after the step."""

    def __init__(self, taps: Taps, size: int) -> None:
        import tensorflow as tf

        super().__init__(taps, size)
        self.amax = tf.Variable(np.zeros(size, np.float32), trainable=False, name="unimp_watch_amax")
        self.counts = tf.Variable(np.zeros((size, 7), np.int32), trainable=False, name="unimp_watch_counts")

    def _write(self, index: int, x: Any, target: str | None) -> list[Any]:
        import tensorflow as tf

        amax, counts = self.measured(x, target)
        return [self.amax.scatter_max(tf.IndexedSlices(amax[None], [index])),
                self.counts.scatter_add(tf.IndexedSlices(counts[None], [index]))]

    def checked(self, index: int, x: Any, target: str | None, then: Any) -> Any:
        import tensorflow as tf

        with tf.control_dependencies(self._write(index, x, target)):
            return tf.identity(then)

    def backward(self, index: int, x: Any, target: str) -> Any:
        import tensorflow as tf

        @tf.custom_gradient
        def tap(x: Any) -> Any:
            return tf.identity(x), lambda g: self.checked(index, g, target, g)

        return tap(x)

    def collect(self) -> None:
        amax, counts = self.amax.numpy(), self.counts.numpy()
        for index in np.flatnonzero(counts[:, -1]):
            self.taps.put(int(index), float(amax[index]), counts[index].tolist())
        self.amax.assign(np.zeros_like(amax))
        self.counts.assign(np.zeros_like(counts))


STORES = {"tensorflow": _TfStore, "jax": _JaxStore, "torch": _TorchStore}


# ---------------------------------------------------------------------- the watch
class KerasWatch:
    """The Keras side of one :class:`unimp.watch.Watch` on one :class:`~unimp_keras.amp.KerasAmp`."""

    def __init__(self, amp: Any, session: Any) -> None:
        self.amp, self.session, self.model = amp, session, amp.model
        self.localize = session.localize
        self.backend = keras.backend.backend()
        opt = amp.optimizer
        self.units = [(u.path, u.layer, _decide(amp.plan, u)[0]) for u in amp._binding.units
                      if not (u.container and is_graph(u.layer))]
        self.taps = Taps()
        self.store = STORES[self.backend](self.taps, 5 * len(self.units))  # input, output and 3 gradients
        self.tapping = False  # while a tapped train_step runs (TensorFlow, JAX: while it is traced)
        self.step = int(opt._steps.value)  # the index of the next step
        self.skipped = int(opt._skipped.value)
        self.train_step = self.model.train_step  # Keras' (or the model's own)
        self._undo: list[tuple[Any, Any, str]] = []  # instance methods set: (object, its own before, name)
        self._install()

    # ------------------------------------------------------------------ install
    def _install(self) -> None:
        for path, layer, compute in self.units:
            self._patch_call(path, layer, compute)
        model = self.model
        self._undo.append((model, model.__dict__.get("train_step"), "train_step"))  # set by each train function
        make = functools.partial(self._make_train_function, model.make_train_function)
        set_method(model, "make_train_function", make, self._undo)
        self._patch_check_finite()
        reset_compiled_functions(model)  # traced again: through the dispatcher

    def _patch_check_finite(self) -> None:
        """The optimizer's finiteness check, in a tapped step, also checks each parameter gradient (a
        ``grad_param`` of the innermost report layer holding the variable)."""
        opt, model = self.amp.optimizer, self.model
        owner = {id(w): path for path, layer, _ in sorted(self.units, key=lambda u: len(u[1].trainable_weights),
                                                          reverse=True) for w in layer.trainable_weights}
        original = opt.check_finite

        def check_finite(grads: list) -> Any:
            finite = original(grads)
            variables = model.trainable_variables
            if not self.tapping or len(variables) != len(grads):
                return finite
            for v, g in zip(variables, grads, strict=True):
                path = owner.get(id(v))
                if path is None or g is None:
                    continue
                g = g.values if type(g).__name__ == "IndexedSlices" else g
                tap = self.taps.tap(path, "grad_param", keras.backend.standardize_dtype(g.dtype))
                finite = self.store.checked(tap, g, None, finite)  # an event only: its finiteness
            return finite

        set_method(opt, "check_finite", check_finite, self._undo)

    def _patch_call(self, path: str, layer: Any, compute: str | None) -> None:
        """The taps around ``layer``'s own call (inside a stream cast's, whose ``inner`` it is then)."""
        name = call_name(layer)
        current = getattr(layer, name)
        holder, attr = (current, "inner") if getattr(current, "inner", None) is not None else (layer, name)
        original = getattr(holder, attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.tapping:
                return original(*args, **kwargs)
            return self._layer_call(path, compute, original, args, kwargs)

        set_method(holder, attr, call, self._undo)

    # ------------------------------------------------------------------ in the tapped step
    @staticmethod
    def _target(x: Any, compute: str | None) -> str:
        return measured_in(keras.backend.standardize_dtype(x.dtype), compute)

    def _tapped(self, path: str, compute: str | None, leaves: list, tensor: str) -> bool:
        """Tap the first float tensor of ``leaves`` (in place): ``tensor`` in the forward, ``grad_<tensor>``."""
        first = next((i for i, t in enumerate(leaves) if _is_float(t)), None)
        if first is None:
            return False
        x, target = leaves[first], self._target(leaves[first], compute)
        x = self.store.forward(self.taps.tap(path, tensor, target), x, target)
        leaves[first] = self.store.backward(self.taps.tap(path, f"grad_{tensor}", target), x, target)
        return True

    def _layer_call(self, path: str, compute: str | None, original: Any, args: tuple, kwargs: dict) -> Any:
        if self.localize:
            leaves = keras.tree.flatten((args, kwargs))
            if self._tapped(path, compute, leaves, "input"):
                args, kwargs = keras.tree.pack_sequence_as((args, kwargs), leaves)
        out = original(*args, **kwargs)
        leaves = keras.tree.flatten(out)
        if not self._tapped(path, compute, leaves, "output"):
            return out
        return leaves[0] if not isinstance(out, list | tuple | dict) else keras.tree.pack_sequence_as(out, leaves)

    def _variables(self) -> tuple[Any, Any, Any]:
        opt = self.model.optimizer
        if opt is not self.amp.optimizer:
            raise UnsupportedError(f"amp.watch(): model {self.model.name!r} is compiled with "
                                   f"{type(opt).__name__}, not the Amp's optimizer; compile it with "
                                   f"model.compile(optimizer=amp.optimizer, ...) so that the watch sees its steps")
        return opt._steps, opt._skipped, opt.dynamic_scale

    def _step(self, mode: int, *args: Any) -> Any:
        """Keras' ``train_step`` (:data:`MODES`), its logs with the scaler's scalars under :data:`INFO`."""
        steps, skipped, scale = self._variables()
        if mode:
            self.taps.tracing()
        self.tapping, self.store.full = bool(mode), mode == MEASURED
        try:
            if self.backend == "jax":  # train_step(state, data): the optimizer's variables are state[2]
                state = args[0]
                at = {id(v): i for i, v in enumerate(self.model.optimizer.variables)}
                before = state[2]
                logs, state = self.train_step(*args)
                info = {"steps": before[at[id(steps)]], "scale": before[at[id(scale)]],
                        "skipped": state[2][at[id(skipped)]]}
                return {**logs, INFO: info}, state
            info = {"steps": ops.copy(steps.value), "scale": ops.copy(scale.value)}
            logs = self.train_step(*args)
            info["skipped"] = ops.copy(skipped.value)
            return {**logs, INFO: info}
        finally:
            self.tapping = False

    # ------------------------------------------------------------------ the train function
    def _make_train_function(self, make: Callable[..., Any], force: bool = False) -> Any:
        model = self.model
        if model.train_function is not None and not force:
            return model.train_function
        if model.steps_per_execution > 1:
            raise UnsupportedError(f"amp.watch(): model {model.name!r} is compiled with steps_per_execution="
                                   f"{model.steps_per_execution}; the watch samples single steps: compile with "
                                   f"steps_per_execution=1 while watching")
        if self.backend == "torch" and model.jit_compile:
            raise UnsupportedError("amp.watch(): Keras on torch with jit_compile=True (torch.compile) is not watched "
                                   "yet; compile the model with jit_compile=False while watching")
        built = []
        for mode in range(len(MODES)):  # each traced on its first step
            step = functools.partial(self._step, mode)
            object.__setattr__(model, "train_step", step)  # TensorFlow and JAX take it when they build
            make(force=True)
            built.append((model.train_function, step))
        model.train_function = functools.partial(self._run, built)
        return model.train_function

    def _run(self, built: list[tuple[Any, Any]], *args: Any) -> Any:
        """One training step: measured when sampled, checked on the others with ``localize``, else plain."""
        sampled = self.session.sampled(self.step)
        mode = MEASURED if sampled else CHECKED if self.localize and not self.session.closed else PLAIN
        function, step = built[mode]
        object.__setattr__(self.model, "train_step", step)  # torch takes it at each call
        out = function(*args)
        logs = out[0] if self.backend == "jax" else out
        info = logs.pop(INFO)
        self.step += 1
        self._read(info, sampled, bool(mode))
        return out

    def _read(self, info: dict[str, Any], sampled: bool, tapped: bool) -> None:
        """Record the step, if it was sampled or skipped (an unsampled one costs the host one scalar)."""
        count = int(ops.convert_to_numpy(info["skipped"]))
        skipped, self.skipped = count > self.skipped, count
        if tapped:
            self.store.collect()
        layers, events = self.taps.take(measured=sampled) if tapped else ([], [])
        if not (sampled or skipped) or self.session.closed:
            return
        step, scale = (ops.convert_to_numpy(info[k]).item() for k in ("steps", "scale"))
        self.step = int(step) + 1  # the scaler's count (the host's own counts the steps it dispatched)
        notes = [NOT_LOCATED] if skipped and not tapped else []
        self.session.add(int(step), skipped=skipped, scale=float(scale), sampled=sampled, layers=layers,
                         events=events, notes=notes)

    def close(self) -> None:
        """Undo: the taps and the dispatcher removed. A ``fit`` running on (the watch closed from a callback, or
        by a full disk under its file) finishes on the plain train function; the next ``compile`` builds Keras'
        own again."""
        running = self.model.train_function
        for obj, own, name in reversed(self._undo):
            restore(obj, own, name)
        self._undo.clear()
        reset_compiled_functions(self.model)
        if isinstance(running, functools.partial) and running.func == self._run:
            self.model.train_function = functools.partial(_closed, running.args[0][PLAIN][0])
        if self.amp._watching is self:
            self.amp._watching = None


def _closed(plain: Any, *args: Any) -> Any:
    """The plain train function of a closed watch: Keras' step, the scaler's scalars dropped from its logs."""
    out = plain(*args)
    (out[0] if keras.backend.backend() == "jax" else out).pop(INFO, None)
    return out


def start(amp: Any, session: Any) -> KerasWatch:
    """``amp.watch(...)``: bind ``session`` (the core's :class:`unimp.watch.Watch`) to the Keras Amp ``amp``."""
    if amp.optimizer is None:
        raise UnsupportedError("amp.watch(): a watch counts training steps through the Amp's optimizer; apply the "
                               "policy with one: amp = unimp.apply(policy, model, keras.optimizers.Adam(...))")
    if keras.backend.backend() == "jax" and keras.config.is_nnx_enabled():
        raise UnsupportedError("amp.watch(): Keras on JAX with NNX enabled builds train_step from the model's "
                               "class; watch with keras.config.set_nnx_enabled(False)")
    if keras.backend.backend() == "tensorflow":
        from .tf_distribute import is_distributed

        if is_distributed(getattr(amp.model, "_distribute_strategy", None)):
            raise UnsupportedError("amp.watch(): not available under a tf.distribute strategy yet (its taps write "
                                   "variables of one replica); watch a single-device run of the model")
    watch = KerasWatch(amp, session)
    session.bind(watch.step, watch.close)
    amp._watching = watch
    return watch
