"""The loss-scale replay every backend runs: its scaler against the reference, every knob, the same
seeded random sequences (floors, caps, the subnormal range, ``growth_interval = 1``, hysteresis).

A backend's tests give a *runner*: ``run(spec, sequences)`` drives the backend's scaler over each
sequence of finite/non-finite steps and returns one :class:`Replay` per sequence (scale and skip
decision after each step, where ``at_min = "error"`` stopped it, the final state). Runners may
vectorise (a batch of sequences in one tensor) as long as each sequence is replayed on its own::

    from unimp.conformance.loss_scale import check_loss_scale_replay

    def test_loss_scale_replay():
        check_loss_scale_replay(my_runner, effective=my_backend.scaler.device_spec)

``effective(spec)`` is the spec the backend really runs (its Plan's fallbacks for knobs it cannot
honour on this device); the trajectory must equal the reference's for *that* spec, bit for bit.

>>> from unimp.loss_scale import LossScale, LossScaleAtMinimumError
>>> def python_runner(spec, seqs):
...     return [reference(spec, s) for s in seqs]
>>> check_loss_scale_replay(python_runner, n_specs=4, n_sequences=2, max_len=50) > 0
True
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from unimp.dtypes import FLT_MAX
from unimp.loss_scale import LossScale, LossScaleAtMinimumError, LossScaleState
from unimp.policy import LossScaleSpec
from unimp.policy.loading import load

#: Edge cases every backend replays (on top of seeded random knobs): the float32 cap (item: growth
#: at FLT_MAX clamps, the finiteness check must not override it), floors, the subnormal range,
#: growth every step, hysteresis, non-power-of-two factors, each knob's every value.
EDGE_KNOBS: tuple[dict[str, Any], ...] = (
    {},
    {"initial": 2.0 ** 127, "growth_interval": 1, "max": FLT_MAX, "on_max": "clamp", "min": 2.0 ** -126},
    {"initial": 2.0 ** 126, "growth_interval": 1, "max": float("inf"), "growth_requires_finite": True},
    {"initial": 2.0 ** 126, "growth_interval": 1, "max": float("inf"), "growth_requires_finite": False},
    {"initial": 2.0 ** -120, "min": 0.0, "growth_interval": 3, "max": float("inf")},
    {"initial": 2.0 ** -120, "min": 0.0, "growth_interval": 3, "subnormal": "flush", "max": float("inf")},
    {"initial": 2.0 ** -120, "min": 0.0, "backoff_factor": 0.3, "growth_factor": 1.5, "max": float("inf")},
    {"initial": 2.0 ** -120, "min": 0.0, "backoff_factor": 0.3, "factor_arithmetic": "float32",
     "max": float("inf")},
    {"initial": 2.0 ** 127, "growth_interval": 1, "scale_dtype": "float64", "max": float("inf"),
     "growth_requires_finite": False},
    {"initial": 2.0 ** -120, "min": 0.0, "scale_dtype": "float64", "max": float("inf")},
    {"growth_schedule": "window", "hysteresis": 2, "hysteresis_refill": ["growth"], "at_min": "error",
     "initial": 64.0, "min": 1.0, "growth_interval": 2},
    {"growth_schedule": "interval_plus_one", "on_max": "clamp", "max": 100.3, "growth_factor": 3.0,
     "backoff_factor": 0.25, "initial": 8.0, "growth_interval": 1},
    {"hysteresis": 3, "hysteresis_refill": ["finite", "backoff"], "min": 2.5, "initial": 40.0},
    {"hysteresis": 2, "hysteresis_refill": [], "on_max": "keep", "max": 300.0, "initial": 16.0},
    {"growth_factor": 1.1, "backoff_factor": 0.9, "factor_arithmetic": "float32", "initial": 3.0, "min": 0.5},
    {"initial": 43614.2109375, "growth_factor": 1.1, "backoff_factor": 1 / 1.1, "backoff": "divide",
     "factor_arithmetic": "float32", "growth_interval": 2, "min": 1.0, "max": float("inf")},
    {"initial": 2.0 ** -120, "min": 0.0, "growth_factor": 3.0, "backoff_factor": 1 / 3.0, "backoff": "divide",
     "max": float("inf")},
    {"initial": 2.0 ** -140, "min": 0.0, "growth_interval": 2, "max": float("inf")},  # GradScaler(init_scale=2**-140)
    {"mode": "static", "initial": 128.0},
    {"mode": "none", "skip_nonfinite": False},
    {"mode": "dynamic", "skip_nonfinite": False, "initial": 8.0},
)

_CHOICES = {
    "initial": (1.0, 3.0, 8.0, 65536.0, 2.0 ** 100, 1.5e38, 2.0 ** -100, 2.0 ** -125),
    "growth_factor": (1.5, 2.0, 3.7, 1.1),
    "backoff_factor": (0.5, 0.3, 0.999, 0.125),
    "growth_interval": (1, 1, 2, 3, 5),
    "hysteresis": (1, 1, 2, 3),
    "min": (0.0, 0.0, 1.0, 2.5, 2.0 ** -130),
    "max": (float("inf"), 1e4, FLT_MAX, 3.0e38),
    "growth_schedule": ("interval", "interval_plus_one", "window"),
    "on_max": ("keep", "clamp"),
    "growth_requires_finite": (True, False),
    "at_min": ("clamp", "clamp", "error"),
    "scale_dtype": ("float32", "float32", "float64"),
    "subnormal": ("keep", "flush"),
    "factor_arithmetic": ("float64", "float32"),
}


@dataclass(frozen=True)
class Replay:
    """One sequence replayed: ``scales[i]`` / ``skips[i]`` after step i; ``error_at``: the step at
    which ``at_min = "error"`` stopped it (its entries stop before it) or None; ``final``: the state
    after the last replayed step (None: the runner does not report it)."""

    scales: Sequence[float]
    skips: Sequence[bool]
    error_at: int | None = None
    final: LossScaleState | None = None
    stop: int | None = None  # a real system that cannot be driven past this step (e.g. its scale is 0)


Runner = Callable[[LossScaleSpec, list[list[bool]]], list[Replay]]


def reference(spec: LossScaleSpec, finites: Sequence[bool]) -> Replay:
    """The reference's :class:`Replay` of one sequence."""
    rule = LossScale(spec)
    st = rule.initial_state()
    scales: list[float] = []
    skips: list[bool] = []
    for i, f in enumerate(finites):
        try:
            out = rule.update(st, bool(f))
        except LossScaleAtMinimumError:
            return Replay(scales, skips, i, st)
        st = out.state
        scales.append(out.scale)
        skips.append(out.skipped)
    return Replay(scales, skips, None, st)


def knob_specs(n_specs: int = 24, seed: int = 0) -> list[LossScaleSpec]:
    """The edge cases, then seeded random knob combinations, ``n_specs`` in all (each validated)."""
    rng = random.Random(seed)
    out = [_spec(k) for k in EDGE_KNOBS]
    while len(out) < n_specs:
        knobs: dict[str, Any] = {k: rng.choice(v) for k, v in _CHOICES.items()}
        knobs["hysteresis_refill"] = [e for e in ("finite", "growth", "backoff") if rng.random() < 0.5]
        if knobs["min"] > knobs["initial"] or knobs["initial"] > knobs["max"]:
            knobs["min"], knobs["max"] = 0.0, float("inf")
        out.append(_spec(knobs))
    return out[:n_specs]


def _spec(knobs: dict[str, Any]) -> LossScaleSpec:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skip_nonfinite = false with dynamic scaling warns
        return load({"loss_scale": {"mode": "dynamic", **knobs}}).loss_scale


def sequences(n: int, min_len: int = 50, max_len: int = 300, seed: int = 0) -> list[list[bool]]:
    """``n`` seeded sequences of finite (True) / non-finite steps: segments of random length and
    overflow rate (1% to 99.5%), so scales reach their floor, their cap and the subnormal range."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(min_len, max_len)
        seq: list[bool] = []
        while len(seq) < length:
            p_bad = rng.choice((0.01, 0.05, 0.3, 0.6, 0.9, 0.995))
            seq += [rng.random() >= p_bad for _ in range(rng.randint(1, max(2, length // 4)))]
        out.append(seq[:length])
    return out


def check_loss_scale_replay(run: Runner, *, effective: Callable[[LossScaleSpec], LossScaleSpec] = lambda s: s,
                            specs: Sequence[LossScaleSpec] | None = None, n_specs: int = 24,
                            n_sequences: int = 8, min_len: int = 50, max_len: int = 300, seed: int = 0) -> int:
    """Replay every spec over the same seeded sequences through ``run`` and the reference (of
    ``effective(spec)``); raise AssertionError naming the spec, sequence and step of the first
    difference. Returns the number of sequences compared."""
    specs = list(specs) if specs is not None else knob_specs(n_specs, seed)
    seqs = sequences(n_sequences, min_len, max_len, seed)
    count = 0
    for spec in specs:
        want_spec = effective(spec)
        got = run(spec, seqs)
        assert len(got) == len(seqs), f"runner returned {len(got)} replays for {len(seqs)} sequences"
        for j, (seq, rep) in enumerate(zip(seqs, got, strict=True)):
            _compare(want_spec, j, reference(want_spec, seq), rep)
            count += 1
    return count


def _compare(spec: LossScaleSpec, j: int, want: Replay, got: Replay) -> None:
    where = f"sequence {j} under {spec}"
    n = len(want.scales)
    if got.stop is not None and got.stop < n:
        n, want = got.stop, Replay(want.scales[:got.stop], want.skips[:got.stop], None, None)
        got = Replay(got.scales[:n], got.skips[:n], None, None)
    assert len(got.scales) >= n and len(got.skips) >= n, f"{len(got.scales)} steps replayed, reference {n}; {where}"
    for i in range(n):
        a, b = float(got.scales[i]), want.scales[i]
        if not (a == b or (a != a and b != b)):
            raise AssertionError(f"step {i}: scale {a!r} != reference {b!r}; {where}")
        if bool(got.skips[i]) != want.skips[i]:
            raise AssertionError(f"step {i}: skipped {bool(got.skips[i])} != reference {want.skips[i]}; {where}")
    assert got.error_at == want.error_at, f"at_min error at {got.error_at} != reference {want.error_at}; {where}"
    if got.final is not None:
        assert got.final == want.final, f"final state {got.final} != reference {want.final}; {where}"


# ---------------------------------------------------------------- replays against the real systems

#: Growth intervals the system replays cycle through (small, so that scales reach their cap).
SYSTEM_INTERVALS = (1, 2, 3, 7)
FULL_REPLAY = "UNIMP_FULL_REPLAY"  # set to 1: 200 sequences of 50-4,200 steps per system


def replay_size(fraction: float = 1.0) -> tuple[int, int]:
    """(sequences, longest) of a system replay: 200 x 4,200 with ``UNIMP_FULL_REPLAY=1``, else
    16 x 600 times ``fraction`` (for systems whose own object is slow to drive)."""
    import os

    return (200, 4200) if os.environ.get(FULL_REPLAY) else (max(1, int(16 * fraction)), int(600 * fraction))


def system_cases(spec: LossScaleSpec, n: int = 200, max_len: int = 4200, seed: int = 19,
                 min_len: int = 50) -> list[tuple[LossScaleSpec, list[bool]]]:
    """``n`` seeded sequences for one system's preset, each with a growth interval from
    :data:`SYSTEM_INTERVALS` (long overflow runs drive scales to the floor and the subnormal
    range; small intervals drive them to the cap and past float32's max)."""
    import dataclasses

    seqs = sequences(n, min_len, max_len, seed)
    return [(dataclasses.replace(spec, growth_interval=SYSTEM_INTERVALS[j % len(SYSTEM_INTERVALS)]), s)
            for j, s in enumerate(seqs)]


def digest(rep: Replay) -> str:
    """A bit-exact fingerprint of a replay (every scale's float64 bits, every skip, the error step)."""
    import hashlib
    import struct

    h = hashlib.sha256()
    h.update(struct.pack(f"<{len(rep.scales)}d", *map(float, rep.scales)))
    h.update(bytes(bool(x) for x in rep.skips))
    h.update(repr(rep.error_at).encode())
    return h.hexdigest()[:16]


def check_system_replay(native: Callable[[LossScaleSpec, list[bool]], Replay], spec: LossScaleSpec, *,
                        n: int | None = None, max_len: int | None = None, seed: int = 19,
                        backend: Runner | None = None,
                        effective: Callable[[LossScaleSpec], LossScaleSpec] = lambda s: s) -> int:
    """The real system (``native(spec, sequence)``, driving the system's own object) against the
    reference of its preset ``spec``, bit for bit, on every sequence of :func:`system_cases`; then
    the backend's scaler (``backend``, a :data:`Runner`) on the same sequences. Returns how many
    sequences matched (all of them, or an AssertionError locates the first difference)."""
    if n is None or max_len is None:
        n, max_len = replay_size()
    cases = system_cases(spec, n, max_len, seed)
    for j, (s, seq) in enumerate(cases):
        _compare(s, j, reference(s, seq), native(s, seq))  # native: the system's own object
    if backend is not None:
        groups: dict[LossScaleSpec, list[int]] = {}
        for j, (s, _) in enumerate(cases):
            groups.setdefault(s, []).append(j)
        for s, idx in groups.items():
            got = backend(s, [cases[j][1] for j in idx])
            want_spec = effective(s)
            for j, rep in zip(idx, got, strict=True):
                _compare(want_spec, j, reference(want_spec, cases[j][1]), rep)
    return len(cases)
