"""The jitted scaler against the core reference, Flax DynamicScale and jmp (expected values from them)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from unimp.conformance.loss_scale import (
    EDGE_KNOBS,
    Replay,
    check_loss_scale_replay,
    check_system_replay,
    replay_size,
)
from unimp.errors import UnsupportedError
from unimp.loss_scale import LossScale, LossScaleAtMinimumError
from unimp.policy.loading import load
from unimp_jax.scaler import (
    check,
    device_spec,
    flushes_subnormals,
    initial_tree,
    to_state,
    update_tree,
    validate,
)


def _spec(knobs):
    base = {"mode": "dynamic", "initial": 64.0, "growth_interval": 3, "min": 1.0}
    return load({"loss_scale": {**base, **knobs}}).loss_scale


def _run(spec, finites):
    spec = device_spec(spec)  # the fallbacks the Plan names (the scaler refuses a knob it cannot honour)
    step = jax.jit(lambda t, f: update_tree(spec, t, f))
    tree, out = initial_tree(spec), []
    for f in finites:
        tree = step(tree, jnp.asarray(f))
        out.append(tree)
    return out


def _jit_runner(spec, seqs):
    """update_tree jitted, vmapped over the sequences (padded), scanned over the steps."""
    spec = device_spec(spec)  # the fallbacks the Plan names (the scaler refuses a knob it cannot honour)
    T = max(len(s) for s in seqs)
    finites = jnp.asarray([list(s) + [True] * (T - len(s)) for s in seqs]).T  # [T, B]

    if spec.backoff == "divide":  # scanned on the scalar state a training step holds: XLA:CPU's
        # vectorised float32 division (a vmapped batch) is not correctly rounded, its scalar one is
        @jax.jit
        def scan(f):
            return jax.lax.scan(lambda t, x: (update_tree(spec, t, x),) * 2, initial_tree(spec), f)[1]

        per_seq = [scan(finites[:, b]) for b in range(len(seqs))]
        trees = jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs], axis=1), *per_seq)
    else:
        step = jax.jit(jax.vmap(lambda t, x: update_tree(spec, t, x)))  # one compile per spec
        tree = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (len(seqs),)), initial_tree(spec))
        history = []
        for f in finites:
            tree = step(tree, f)
            history.append(tree)
        trees = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *history)
    scales = np.asarray(trees.scale, np.float64)
    skipped, error = np.asarray(trees.skipped), np.asarray(trees.at_min_error)
    out = []
    for b, seq in enumerate(seqs):
        n = len(seq)
        hit = np.flatnonzero(error[:n, b])
        frozen_at = int(hit[0]) if hit.size else None
        before = float(scales[frozen_at - 1, b]) if frozen_at else float(np.asarray(initial_tree(spec).scale))
        at_min = frozen_at is not None and spec.at_min == "error" and before <= spec.min
        error_at = frozen_at if at_min else None  # else: the subnormal stop (stops_below_tiny)
        stop = frozen_at if frozen_at is not None else n
        skips = np.diff(np.concatenate([[0], skipped[:stop, b]])) > 0
        last = jax.tree_util.tree_map(lambda x, i=n - 1, b=b: x[i, b], trees)
        final = None if error_at is not None else to_state(last)
        out.append(Replay(list(scales[:stop, b]), list(skips), error_at, final,
                          stop=frozen_at if frozen_at is not None and not at_min else None))
    return out


def test_jitted_rule_replays_the_reference_for_every_knob():
    """The conformance replay; where this device cannot honour a knob (XLA:CPU flushes float32
    subnormals; no float64 without jax_enable_x64) the reference of what the Plan says runs."""
    n = len(EDGE_KNOBS)  # one XLA compile per spec: the edge cases here, random knobs in the slow test
    assert check_loss_scale_replay(_jit_runner, effective=device_spec, n_specs=n, n_sequences=8) == 8 * n


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("UNIMP_FULL_REPLAY"), reason="the full replay: set UNIMP_FULL_REPLAY=1")
def test_jitted_rule_replays_the_reference_for_random_knobs():
    assert check_loss_scale_replay(_jit_runner, effective=device_spec, n_specs=60, n_sequences=16) == 16 * 60


def test_the_plan_names_the_knobs_this_device_cannot_honour():
    spec = _spec({"min": 0.0, "scale_dtype": "float64"})
    with pytest.raises(UnsupportedError, match=r"scale_dtype = 'float64' cannot be honoured.*jax_enable_x64"):
        validate(spec, "test policy")
    notes = validate(spec, "test policy", "fallback")
    assert any("scale_dtype" in n and "runs as 'float32'" in n for n in notes)
    assert device_spec(spec).scale_dtype == "float32"
    assert any("subnormal = 'keep' cannot be honoured" in n for n in notes) == flushes_subnormals()


def test_a_scale_entering_the_subnormal_range_stops_where_the_device_flushes():
    """XLA:CPU flushes float32 subnormals: with subnormal = "keep" the step that would go below
    2^-126 is not applied and the host check raises, instead of silently flushing."""
    spec = _spec({"min": 0.0, "initial": 2.0 ** -125, "growth_interval": 5})
    trees = _run(spec, [False, False, False])
    check(trees[0], spec)
    assert to_state(trees[0]).scale == 2.0 ** -126
    if flushes_subnormals():
        with pytest.raises(UnsupportedError, match="subnormal = 'flush'"):
            check(trees[1], spec)
        assert to_state(trees[2]) == to_state(trees[0])
    else:
        assert to_state(trees[1]).scale == 2.0 ** -127
    flush = _spec({"min": 0.0, "initial": 2.0 ** -125, "subnormal": "flush"})
    assert [to_state(t).scale for t in _run(flush, [False, False])] == [2.0 ** -126, 0.0]


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


def _flax(spec, seq):
    return Replay(_flax_scales(spec, seq), [not f for f in seq])


def _jmp(spec, seq):
    import jmp

    factor = int(spec.growth_factor) if spec.growth_factor.is_integer() else spec.growth_factor
    ls = jmp.DynamicLossScale(jnp.float32(spec.initial), period=spec.growth_interval,
                              factor=factor, min_loss_scale=jnp.float32(spec.min))
    adjust = jax.jit(lambda ls, f: ls.adjust(f))
    scales = []
    for f in seq:
        ls = adjust(ls, jnp.asarray(f))
        scales.append(float(ls.loss_scale))
    return Replay(scales, [not f for f in seq])


def test_flax_dynamic_scale_replays_its_preset_and_the_jitted_rule():
    """Flax DynamicScale (driven through its own value_and_grad) = flax_dynamic_scale reference =
    unimp_jax's jitted rule, on the system replay sequences (floor at float32 tiny, cap FLT_MAX)."""
    n, longest = replay_size(0.5)  # one jitted step per real step: half the default replay
    assert check_system_replay(_flax, load("flax_dynamic_scale").loss_scale, n=n, max_len=longest,
                               backend=_jit_runner, effective=device_spec) == n


def test_jmp_dynamic_loss_scale_replays_its_preset_and_the_jitted_rule():
    pytest.importorskip("jmp")
    n, longest = replay_size(0.5)
    assert check_system_replay(_jmp, load("jmp_float16").loss_scale, n=n, max_len=longest,
                               backend=_jit_runner, effective=device_spec) == n


def _jmp_eager(spec, seq):
    """jmp's adjust() called eagerly (each jnp op run as it comes): its ``loss_scale / factor`` is a
    true division there."""
    import jmp

    factor = int(spec.growth_factor) if spec.growth_factor.is_integer() else spec.growth_factor
    ls = jmp.DynamicLossScale(jnp.float32(spec.initial), period=spec.growth_interval, factor=factor,
                              min_loss_scale=jnp.float32(spec.min))
    scales = []
    for f in seq:
        ls = ls.adjust(jnp.asarray(f))
        scales.append(float(ls.loss_scale))
    return Replay(scales, [not f for f in seq])


@pytest.mark.parametrize("factor", [3, 1.1, 10])
def test_jmp_non_2_factor_replays_jitted_and_eager(factor):
    """jmp's DynamicLossScale.adjust writes its backoff ``self.loss_scale / self.factor``
    (google-deepmind/jmp@9c1cdbbf, jmp/_src/loss_scale.py). Under jax.jit, as a training step runs it,
    XLA makes that ``loss_scale * (1 / factor)`` in float32 (openxla/xla algebraic_simplifier.cc,
    HandleDivide: A / Const => A * InvertConstant(Const)): the jmp import of the same arguments
    replays the jitted object. Called eagerly it divides: ``backoff = "divide"`` replays that, in the
    reference and in unimp_jax's jitted rule."""
    pytest.importorskip("jmp")
    from unimp.migrate import importers

    kw = {"loss_scale": 43614.2109375, "period": 3, "factor": factor, "min_loss_scale": 1.0}
    jitted = importers.jmp("params=float32,compute=float16,output=float32", kw).policy.loss_scale
    n, longest = replay_size(0.25)
    assert check_system_replay(_jmp, jitted, n=n, max_len=longest, backend=_jit_runner,
                               effective=device_spec) == n
    eager = dataclasses.replace(jitted, backoff="divide", backoff_factor=1.0 / factor)
    n = max(1, n // 2)  # eager jmp: a dispatch per op
    assert check_system_replay(_jmp_eager, eager, n=n, max_len=longest, backend=_jit_runner,
                               effective=device_spec) == n
    first = LossScale(eager).update(LossScale(eager).initial_state(), False).scale
    assert _jmp_eager(eager, [False]).scales == [first]
    if factor == 1.1:  # the case: 43614.2109375 backs off to 39649.28125 in jmp, jitted or not;
        # unimp's import multiplied by float32(1 / 1.1) and gave 39649.28515625
        assert first == _jmp(jitted, [False]).scales[0] == 39649.28125
        old = dataclasses.replace(jitted, backoff_factor=1.0 / factor)
        assert LossScale(old).update(LossScale(old).initial_state(), False).scale == 39649.28515625


def test_flax_dynamic_scale_preset_at_the_float32_cap():
    """Growth past float32 max clamps to float32 max, in Flax and in unimp (the finiteness check
    does not override on_max = "clamp")."""
    base = load("flax_dynamic_scale").replace(loss_scale={"growth_interval": 1, "initial": 2.0 ** 126})
    finites = [True] * 4
    flax = _flax_scales(base.loss_scale, finites)
    assert flax[-1] == float(np.finfo(np.float32).max)
    assert _ours(base.loss_scale, finites) == flax
