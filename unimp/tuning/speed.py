"""Which layers run in FP8, decided by the step the user runs: candidate sets timed as whole training steps.

An isolated GEMM pays its FP8 casts and amax reductions alone; in a compiled model they fuse into the
neighbouring kernels, so a microbenchmark can call a layer slower in FP8 that makes the compiled model
faster (and its verdict moves with the batches it was timed on). The search here times whole steps
(forward and backward of ``loss_fn``, compiled where the user compiles) of candidate sets:

1. no FP8 layer (the compute dtype) — the floor every answer is held to —, every eligible layer in FP8,
   and the backend's named sets (torch: torchao's default and auto filters);
2. from the fastest of those, each group of layers sharing a GEMM shape flipped in turn (largest GEMMs
   first), the flip kept when the step gets faster by more than the noise;
3. the winner is kept only if it beats the no-FP8 step by more than the noise: FP8 that does not pay
   stays in the compute dtype.

The noise is measured, not assumed: the no-FP8 set is timed twice (an A/A pair) and a difference must
exceed ``max(NOISE_FLOOR, 2 x |A/A|)`` to count. Every set timed is kept (:class:`SpeedSearch.timed`), so the
policy file can say which measurement decided each layer.

>>> times = {frozenset(): 10.0, frozenset("ab"): 9.0, frozenset("a"): 8.0, frozenset("b"): 11.0}
>>> s = SpeedSearch(["a", "b"], {"a": (4, 8, 8), "b": (4, 8, 16)}, times.__getitem__, {})
>>> sorted(s.best()), s.noise
(['a'], 0.005)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from unimp.tuning.measurements import Shape

NOISE_FLOOR = 0.005  # a difference below 0.5% of a step is never taken as a speed-up


@dataclass(frozen=True)
class Timed:
    """One candidate set of FP8 layers and its measured step time (seconds; the unit does not matter)."""

    name: str
    layers: frozenset[str]
    seconds: float


class SpeedSearch:
    """The FP8 set whose measured step is fastest; ``timer(layers)`` times one step with ``layers`` in FP8."""

    def __init__(self, eligible: Sequence[str], shapes: Mapping[str, Shape], timer: Callable[[frozenset[str]], float],
                 named: Mapping[str, Sequence[str]]) -> None:
        self.eligible = list(eligible)
        self.shapes, self.timer = shapes, timer
        ok = set(self.eligible)
        self.named = {n: frozenset(p for p in ps if p in ok) for n, ps in named.items()}
        self.timed: list[Timed] = []
        self._cache: dict[frozenset[str], float] = {}
        self.floor = self.time("no FP8 layer", frozenset())  # the step every answer is held to
        again = self.timer(frozenset())
        self.timed.append(Timed("no FP8 layer (A/A repeat)", frozenset(), again))
        self.noise = max(NOISE_FLOOR, 2 * abs(again - self.floor) / self.floor)

    def time(self, name: str, layers: frozenset[str]) -> float:
        if layers not in self._cache:
            self._cache[layers] = self.timer(layers)
            self.timed.append(Timed(name, layers, self._cache[layers]))
        return self._cache[layers]

    def groups(self) -> list[frozenset[str]]:
        """The eligible layers grouped by GEMM shape (layers of unknown shape each alone), largest first."""
        by: dict[object, set[str]] = {}
        for p in self.eligible:
            by.setdefault(self.shapes.get(p, p), set()).add(p)
        flops = {k: (k[0] * k[1] * k[2] if isinstance(k, tuple) else 0) * len(v) for k, v in by.items()}
        return [frozenset(by[k]) for k in sorted(by, key=lambda k: (-flops[k], str(k)))]

    def faster(self, a: float, b: float) -> bool:
        """Whether ``a`` beats ``b`` by more than the noise."""
        return a < b * (1 - self.noise)

    def best(self) -> frozenset[str]:
        """The fastest set found (see the module's steps); the empty set when no FP8 set beats the floor."""
        if not self.eligible:
            return frozenset()
        seeds = {"every eligible layer": frozenset(self.eligible), **self.named}
        current = min((frozenset(), *seeds.values()), key=lambda s: (self.time(self._name(s, seeds), s), len(s)))
        for group in self.groups():
            flipped = current ^ group
            if self.faster(self.time(self._name(flipped, seeds), flipped), self._cache[current]):
                current = flipped
        return current if self.faster(self._cache[current], self.floor) else frozenset()

    def _name(self, layers: frozenset[str], seeds: Mapping[str, frozenset[str]]) -> str:
        for n, s in seeds.items():
            if s == layers:
                return n
        return "no FP8 layer" if not layers else f"{len(layers)} layers (shape groups flipped)"
