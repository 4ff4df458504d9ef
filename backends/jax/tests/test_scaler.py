"""The jitted scaler against the core reference, Flax DynamicScale and jmp (expected values from them)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unimp.errors import UnsupportedError
from unimp.loading import load
from unimp.loss_scale import LossScale, LossScaleAtMinimumError
from unimp_jax.scaler import check, initial_tree, to_state, update_tree, validate

KNOBS = [
    {},
    {"growth_schedule": "interval_plus_one", "on_max": "clamp", "max": 512.0},
    {"growth_schedule": "window", "hysteresis": 2, "hysteresis_refill": ["growth"], "growth_requires_finite": False},
    {"hysteresis": 3, "hysteresis_refill": ["finite", "backoff"], "min": 8.0},
    {"hysteresis": 2, "hysteresis_refill": [], "on_max": "keep", "max": 300.0},
    {"growth_requires_finite": False, "max": float("inf"), "initial": 2.0 ** 126, "growth_interval": 1},
    {"growth_requires_finite": True, "max": float("inf"), "initial": 2.0 ** 126, "growth_interval": 1},
    {"on_max": "clamp", "max": 100.3, "growth_factor": 3.0, "backoff_factor": 0.25},
    {"min": 0.0, "backoff_factor": 0.125},
    {"mode": "static", "initial": 128.0},
    {"mode": "none", "skip_nonfinite": False},
    {"skip_nonfinite": False},
]


def _spec(knobs):
    base = {"mode": "dynamic", "initial": 64.0, "growth_interval": 3, "min": 1.0}
    return load({"loss_scale": {**base, **knobs}}).loss_scale


def _run(spec, finites):
    step = jax.jit(lambda t, f: update_tree(spec, t, f))
    tree, out = initial_tree(spec), []
    for f in finites:
        tree = step(tree, jnp.asarray(f))
        out.append(tree)
    return out


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_matches_reference_for_every_knob(knobs):
    spec = _spec(knobs)
    rng = random.Random(len(str(knobs)))
    finites = [rng.random() > 0.3 for _ in range(60)]
    rule, state = LossScale(spec), LossScale(spec).initial_state()
    for i, (f, tree) in enumerate(zip(finites, _run(spec, finites))):
        state = rule.update(state, f).state
        assert to_state(tree) == state, f"step {i}"
        assert np.asarray(tree.scale).dtype == np.float32


def test_at_min_error_is_a_host_check():
    spec = _spec({"at_min": "error", "min": 16.0, "initial": 64.0})
    finites = [True, False, False, False, True]
    rule, state, raised_at = LossScale(spec), LossScale(spec).initial_state(), None
    for i, f in enumerate(finites):
        try:
            state = rule.update(state, f).state
        except LossScaleAtMinimumError:
            raised_at = i
            break
    trees = _run(spec, finites)
    for i, tree in enumerate(trees):
        if i < raised_at:
            check(tree, spec)
        else:
            with pytest.raises(LossScaleAtMinimumError, match="at_min = 'clamp'"):
                check(tree, spec)
            assert to_state(tree) == to_state(trees[raised_at - 1])  # frozen where the reference raised


def test_factor_not_representable_in_float32_is_refused():
    spec = _spec({"growth_factor": 1.1})
    with pytest.raises(UnsupportedError, match=r"loss_scale.growth_factor = 1.1.*fix"):
        validate(spec, "test policy")


# ---------------------------------------------------------------- real implementations


def _flax_scales(spec, finites):
    from flax.training.dynamic_scale import DynamicScale

    ds = DynamicScale(growth_factor=spec.growth_factor, backoff_factor=spec.backoff_factor,
                      growth_interval=spec.growth_interval, scale=spec.initial)

    @jax.jit
    def step(ds, poison):
        def loss(p):
            return jnp.where(poison, jnp.inf, 0.25) * p ** 2  # grad 0.5 * scale: finite up to f32 max
        new_ds, finite, _, _ = ds.value_and_grad(loss)(jnp.float32(1.0))
        return new_ds, finite

    out = []
    for f in finites:
        ds, finite = step(ds, jnp.asarray(not f))
        assert bool(finite) == f
        out.append(float(ds.scale))
    return out


def _ours(spec, finites):
    return [float(np.float32(t.scale)) for t in _run(spec, finites)]


@pytest.mark.parametrize("seed", range(3))
def test_flax_dynamic_scale_preset_replays_flax(seed):
    spec = load("flax_dynamic_scale").replace(loss_scale={"growth_interval": 3}).loss_scale
    rng = random.Random(seed)
    finites = [rng.random() > 0.25 for _ in range(80)]
    assert _ours(spec, finites) == _flax_scales(spec, finites)


def test_flax_dynamic_scale_preset_at_the_float32_cap():
    """Growth past float32 max: Flax clamps to float32 max; the preset (growth_requires_finite=true)
    keeps the old scale instead."""
    base = load("flax_dynamic_scale").replace(loss_scale={"growth_interval": 1, "initial": 2.0 ** 126})
    finites = [True] * 4
    flax = _flax_scales(base.loss_scale, finites)
    assert flax[-1] == float(np.finfo(np.float32).max)
    assert _ours(base.loss_scale, finites) != flax  # the preset as shipped
    fixed = base.replace(loss_scale={"growth_requires_finite": False}).loss_scale
    assert _ours(fixed, finites) == flax  # with the proposed fix


@pytest.mark.parametrize("seed", range(3))
def test_jmp_float16_preset_replays_jmp(seed):
    jmp = pytest.importorskip("jmp")
    spec = load("jmp_float16").replace(loss_scale={"growth_interval": 3}).loss_scale
    rng = random.Random(seed)
    finites = [rng.random() > 0.25 for _ in range(80)]
    ls = jmp.DynamicLossScale(jnp.float32(spec.initial), period=spec.growth_interval,
                              factor=int(spec.growth_factor), min_loss_scale=jnp.float32(spec.min))
    adjust = jax.jit(lambda ls, f: ls.adjust(f))
    theirs = []
    for f in finites:
        ls = adjust(ls, jnp.asarray(f))
        theirs.append(float(ls.loss_scale))
    assert _ours(spec, finites) == theirs
