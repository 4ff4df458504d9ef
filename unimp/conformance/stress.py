"""Lifetimes and interrupts under stress, framework-free: what every backend's lifetime tests drive.

* :func:`sweep`: the hyper-parameter sweep pattern. ``trial(preset)`` applies a policy and trains a
  step; what it returns (model, optimizer, Amp) is dropped without ``amp.remove()``, in a reference
  cycle, ``trials`` times round the presets, while :class:`RandomCollections` runs collections at
  random points (the garbage collector may run at any allocation: inside a lock, between two
  writes), ``gc.freeze()`` / ``gc.unfreeze()`` at two random trials hold dropped Amps back then
  release them at once, all under a :func:`watchdog`, so a deadlock fails with the stack it hung in
  instead of hanging CI.
* :func:`interrupts`: the Ctrl-C pattern: ``KeyboardInterrupt`` raised at the k-th line that runs in
  the named files, for every k (a tracing hook: nothing of the framework is replaced).

>>> preset_cycle(["fp32", "mixed_bf16"], 3)
['fp32', 'mixed_bf16', 'fp32']
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import functools
import gc
import random
import signal
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from unimp.backend import Amp, applied
from unimp.errors import AlreadyAppliedError, UnsupportedError
from unimp.policy.loading import preset_names

_OWN = (f"{Path(__file__).parents[1]}", "unimp_")  # the core's files, and every backend package's


def _ours(path: str) -> bool:
    return path.startswith(_OWN[0]) or _OWN[1] in path


@contextlib.contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Inside (the main thread), a hang fails instead of hanging CI: after ``seconds`` a ``SIGALRM``,
    repeated every 50 ms, raises ``TimeoutError`` where the thread waits (acquiring a lock can be
    interrupted so); one raised in a finalizer is swallowed by the interpreter, so the block fails on
    leaving too, with the first stack it hung in. Should even that not end it, faulthandler dumps every
    thread's traceback and exits the process at ``2 * seconds``."""
    hung: list[str] = []

    def alarm(signum: int, frame: Any) -> None:
        if not hung:
            hung.append("".join(traceback.format_stack(frame)))
        raise TimeoutError(f"unimp watchdog: still running after {seconds} s (a deadlock?); where it hung:\n{hung[0]}")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    faulthandler.dump_traceback_later(2 * seconds, exit=True)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        faulthandler.cancel_dump_traceback_later()
    if hung:
        raise TimeoutError(f"unimp watchdog: still running after {seconds} s (a deadlock?); where it hung:\n{hung[0]}")


class RandomCollections:
    """While entered (in this thread), collections at random points; ``inside`` counts, per function of unimp's,
    the collections that started while it was running (read from ``gc.callbacks``): a test asserts its
    critical sections really saw one.

    Without ``where``: the collector's thresholds are drawn anew after each collection (the youngest
    generation from 1 to ``1 / p`` allocations, the older ones every 2), so collections run where
    allocations happen, in unimp's code or the framework's, at almost no cost. With ``where`` (names of
    unimp's functions): a ``gc.collect()`` at each of their lines with probability ``p`` instead, and
    none elsewhere, so garbage lives until one of them runs (a tracing hook: slower).
    """

    def __init__(self, p: float = 0.1, seed: int = 0, where: Collection[str] | None = None) -> None:
        self.p = p
        self.rng = random.Random(seed)
        self.where = where
        self.collections = 0
        self.inside: collections.Counter[str] = collections.Counter()

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        return self._line if code.co_name in self.where and _ours(code.co_filename) else None  # type: ignore[operator]

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and self.rng.random() < self.p:
            gc.collect()
        return self._line

    def _threshold(self) -> None:
        gc.set_threshold(self.rng.randint(1, max(1, round(1 / self.p))), 2, 2)

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop":
            if self.where is None:
                self._threshold()
            return
        self.collections += 1
        frame: FrameType | None = sys._getframe(1)
        names = set()
        while frame is not None:
            if _ours(frame.f_code.co_filename):
                names.add(frame.f_code.co_name)
            frame = frame.f_back
        self.inside.update(names)

    def __enter__(self) -> RandomCollections:
        self.thresholds = gc.get_threshold()
        gc.callbacks.append(self._seen)
        if self.where is None:
            self._threshold()
        else:
            sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        gc.callbacks.remove(self._seen)
        gc.set_threshold(*self.thresholds)


def runnable(trial: Callable[[str], Any], presets: Sequence[str] | None = None) -> list[str]:
    """The presets (all shipped ones by default) ``trial`` runs here, each run once: its warm-up before a
    :func:`sweep` (an :class:`~unimp.errors.UnsupportedError`: a preset the backend declares it cannot run)."""
    out = []
    for preset in presets if presets is not None else preset_names():
        try:
            trial(preset)
        except UnsupportedError:
            continue
        out.append(preset)
    return out


def sweep_every_preset(trial: Callable[[str], Iterable[Any]], *, seed: int, trials: int = 200,
                       timeout: float = 120.0) -> tuple[list[str], RandomCollections]:
    """:func:`sweep` round every preset ``trial`` runs here (:func:`runnable`, which warms them up), the
    framework's warnings silenced; then a full collection. The presets and the collections' record."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on this CPU, fallbacks, misaligned dims of tiny models
        presets = runnable(trial)
        gcs = sweep(trial, presets, trials, seed=seed, timeout=timeout)
    gc.collect()
    return presets, gcs


def dead_marks() -> list[int]:
    """Ids still marked applied whose object is gone (a leak of the applied marks: must be empty)."""
    return [i for i, entry in applied._applied.items() if isinstance(entry, weakref.ref) and entry() is None]


def preset_cycle(presets: Sequence[str], trials: int) -> list[str]:
    """``trials`` preset names, round the list."""
    return [presets[i % len(presets)] for i in range(trials)]


def sweep(trial: Callable[[str], Iterable[Any]], presets: Sequence[str], trials: int = 200, *, seed: int = 0,
          p: float = 0.1, where: Collection[str] | None = None, timeout: float = 120.0) -> RandomCollections:
    """Run ``trial(preset)`` ``trials`` times round ``presets``, dropping what each returns in a reference
    cycle without ``remove()``, under random collections (``p``, ``where``: :class:`RandomCollections`),
    freezes and a watchdog; returns the collections' record. Warm up first (:func:`runnable`): the freeze
    then keeps the imports out of every collection."""
    rng = random.Random(seed)
    hold, let_go = sorted(rng.sample(range(trials), 2))  # dropped Amps held back in between, then let go at once
    gc.collect()
    gc.freeze()  # what exists now (the frameworks) is never traversed again: collections stay cheap
    try:
        with watchdog(timeout), RandomCollections(p, seed, where) as gcs:
            for i, preset in enumerate(preset_cycle(presets, trials)):
                held: list[Any] = list(trial(preset))
                held.append(held)  # model, optimizer and Amp in a cycle: only a collection frees them
                del held
                if i == hold:
                    gc.freeze()
                elif i == let_go:  # their finalizers run in one collection
                    gc.unfreeze()
                    gc.collect()
                    gc.freeze()
        return gcs
    finally:
        gc.unfreeze()
        gc.collect()


def _line_trace(files: Sequence[str], on_line: Callable[[Any], None]) -> Callable[..., Any]:
    """A ``sys.settrace`` function calling ``on_line(frame)`` at each line run in ``files`` (path suffixes)."""
    suffixes = tuple(files)

    def line(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            on_line(frame)
        return line

    def trace(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename.endswith(suffixes) else None

    return trace


def _interrupt_after(k: int) -> Callable[[Any], None]:
    """An ``on_line`` raising ``KeyboardInterrupt`` at the line after ``k`` others (once, as one Ctrl-C)."""
    left = [k]

    def arrive(frame: Any) -> None:
        if left[0] == 0:
            sys.settrace(None)
            raise KeyboardInterrupt(f"injected at {Path(frame.f_code.co_filename).name}:{frame.f_lineno}")
        left[0] -= 1

    return arrive


def interrupts(files: Sequence[str], run: Callable[[], Any], done: Callable[[Any], None]) -> Iterator[str | None]:
    """The Ctrl-C pattern: for every line that ``run()`` executes in ``files`` (path suffixes), ``run()`` again
    with a ``KeyboardInterrupt`` raised at that line; yields where (None if ``run()`` finished first: then
    ``done(result)``, as after the first, counting run), after each attempt, for the caller's checks."""
    count = [0]

    def seen(frame: Any) -> None:
        count[0] += 1

    sys.settrace(_line_trace(files, seen))
    try:
        result = run()
    finally:
        sys.settrace(None)
    done(result)
    for k in range(count[0]):
        sys.settrace(_line_trace(files, _interrupt_after(k)))
        try:
            result = run()
        except KeyboardInterrupt as e:
            yield str(e)
            continue
        finally:
            sys.settrace(None)
        done(result)
        yield None


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run each call in its own thread, released together by a barrier (the threads really race: set
    ``sys.setswitchinterval(1e-6)`` around it); each call's result or the exception it raised, in order.

    >>> together(lambda: 1, lambda: 1 / 0)[0], type(together(lambda: 1 / 0)[0]).__name__
    (1, 'ZeroDivisionError')
    """
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def run(k: int, call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            out[k] = call()
        except BaseException as e:
            out[k] = e

    threads = [threading.Thread(target=run, args=(k, c)) for k, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def race_applies(build: Callable[[], Any], apply: Callable[[Any], Any], state: Callable[[Any], Any],
                 races: int = 100) -> None:
    """Two threads applying to one fresh ``build()`` model (an evaluation thread beside the trainer), ``races``
    times, the interpreter switching threads every microsecond: exactly one Amp, the other
    ``AlreadyAppliedError`` naming the fix, and after ``remove()`` the model's ``state(model)`` as before."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads really race
    try:
        for k in range(races):
            model = build()
            before = state(model)
            out = together(*[functools.partial(apply, model)] * 2)
            amps = [o for o in out if isinstance(o, Amp)]
            errors = [o for o in out if isinstance(o, AlreadyAppliedError)]
            assert len(amps) == 1 and len(errors) == 1, (k, out)
            assert "already has a unimp policy applied; call amp.remove()" in str(errors[0]), errors[0]
            amps[0].remove()
            assert state(model) == before, k
    finally:
        sys.setswitchinterval(interval)
