"""The FP8 speed search (``unimp.tuning.speed``): whole-step times decide, never slower than no FP8, filters beaten.

The timer here is a table of step times (what a backend's compiled step measured); the search must return the set
the table says is fastest among those it can reach, bounded below by the no-FP8 step and the named filter sets.
"""

from __future__ import annotations

import itertools

import pytest

import unimp
from unimp.tuning.speed import NOISE_FLOOR, SpeedSearch

LAYERS = ["q", "k", "up", "down", "head"]
SHAPES = {"q": (8, 64, 64), "k": (8, 64, 64), "up": (8, 64, 256), "down": (8, 256, 64), "head": (8, 64, 1000)}


def additive(costs: dict[str, float], base: float = 100.0):
    """A step time that adds each FP8 layer's gain (negative: faster) to the no-FP8 step, and the calls made."""
    calls: list[frozenset[str]] = []

    def timer(layers: frozenset[str]) -> float:
        calls.append(layers)
        return base + sum(costs[p] for p in layers)

    return timer, calls


def test_all_fp8_slower_keeps_every_layer_in_the_compute_dtype():
    timer, _ = additive(dict.fromkeys(LAYERS, 1.0))
    assert SpeedSearch(LAYERS, SHAPES, timer, {}).best() == frozenset()


def test_the_groups_that_pay_are_found_and_the_rest_stay_high():
    """An isolated-GEMM verdict would not matter: only the measured steps decide (head slower, the MLP faster)."""
    timer, calls = additive({"q": -1.0, "k": -1.0, "up": -3.0, "down": -3.0, "head": +4.0})
    search = SpeedSearch(LAYERS, SHAPES, timer, {})
    assert search.best() == frozenset({"q", "k", "up", "down"})
    assert len(calls) <= 3 + len(search.groups()) + 1  # floor, A/A, seeds, one flip per shape group


@pytest.mark.parametrize("named", [{"default": ["q", "k", "up", "down"]}, {"auto": ["up", "down"]}])
def test_never_slower_than_the_named_filters(named):
    costs = {"q": 0.5, "k": 0.5, "up": -3.0, "down": -3.0, "head": -0.2}
    timer, _ = additive(costs)
    search = SpeedSearch(LAYERS, SHAPES, timer, named)
    best = search.best()
    t = 100 + sum(costs[p] for p in best)
    assert t <= min(100 + sum(costs[p] for p in s) for s in named.values())
    assert t <= 100  # and never slower than no FP8 layer


def test_a_gain_inside_the_measured_noise_is_not_taken():
    """The A/A pair of the no-FP8 step jitters by 2%: a 1% gain is noise, FP8 stays off."""
    times = iter([100.0, 102.0])  # the floor and its A/A repeat

    def timer(layers: frozenset[str]) -> float:
        return next(times) if not layers else 99.0

    search = SpeedSearch(LAYERS, SHAPES, timer, {})
    assert search.noise == pytest.approx(0.04) and search.best() == frozenset()


def test_exhaustive_reference_on_shape_groups():
    """Against brute force over every union of shape groups (additive costs: the greedy flips are exact)."""
    costs = {"q": -0.7, "k": -0.7, "up": 2.0, "down": -1.5, "head": -0.1}
    timer, _ = additive(costs)
    search = SpeedSearch(LAYERS, SHAPES, timer, {})
    groups = search.groups()
    options = [frozenset().union(*c) for r in range(len(groups) + 1) for c in itertools.combinations(groups, r)]
    brute = min(options, key=lambda s: sum(costs[p] for p in s))
    assert search.best() == brute
    assert abs(sum(costs[p] for p in brute)) > NOISE_FLOOR * 100


def test_tuned_on_is_kept_by_the_file_and_outside_the_fingerprint(tmp_path):
    p = unimp.load("fp8_tensorwise")
    tuned = p.replace(tuned_on="NVIDIA H100 80GB HBM3")
    assert tuned.fingerprint == p.fingerprint
    f = tmp_path / "tuned.toml"
    f.write_text('extends = "fp8_tensorwise"\ntuned_on = "NVIDIA H100 80GB HBM3"\n')
    assert unimp.load(str(f)).tuned_on == "NVIDIA H100 80GB HBM3"
    bad = tmp_path / "bad.toml"
    bad.write_text('extends = "fp8_tensorwise"\ntuned_on = 3\n')
    with pytest.raises(unimp.PolicyError, match="tuned_on"):
        unimp.load(str(bad))
