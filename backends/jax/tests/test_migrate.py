"""`unimp import/export` against the real JAX objects: jmp.DynamicLossScale and Flax DynamicScale
built from the same arguments replay the imported policy's reference trajectory, and the objects
built from an export replay the policy's."""

import random

import jax
import jax.numpy as jnp
import jmp
import pytest
from flax.training.dynamic_scale import DynamicScale

import unimp
from unimp.loss_scale import trajectory
from unimp.migrate import exporters, importers


def _finites(seed, n=120, p_bad=0.25):
    rng = random.Random(seed)
    return [rng.random() > p_bad for _ in range(n)]


def _jmp(kw, finites):
    ls = jmp.DynamicLossScale(jnp.float32(kw["loss_scale"]), period=kw["period"], factor=kw["factor"],
                              min_loss_scale=jnp.float32(kw["min_loss_scale"]))
    adjust = jax.jit(lambda s, f: s.adjust(f))
    out = []
    for f in finites:
        ls = adjust(ls, jnp.asarray(f))
        out.append(float(ls.loss_scale))
    return out


def _flax(kw, finites):
    ds = DynamicScale(**kw)

    @jax.jit
    def step(ds, poison):
        def loss(p):
            return jnp.where(poison, jnp.inf, 0.25) * p ** 2
        new_ds, _, _, _ = ds.value_and_grad(loss)(jnp.float32(1.0))
        return new_ds

    out = []
    for f in finites:
        ds = step(ds, jnp.asarray(not f))
        out.append(float(ds.scale))
    return out


def _jmp_kwargs(seed):
    rng = random.Random(seed)
    return {"loss_scale": 2.0 ** rng.randint(0, 20), "period": rng.randint(1, 5), "factor": rng.choice([2, 4]),
            "min_loss_scale": rng.choice([1.0, 0.25])}


@pytest.mark.parametrize("seed", range(3))
def test_imported_jmp_replays_like_dynamic_loss_scale(seed):
    """Driven through jax.jit, as a training step runs it (jmp's pytree drops min_loss_scale there:
    the import says so with a warning and imports the floor the jitted step has)."""
    kw = _jmp_kwargs(seed)
    if kw["min_loss_scale"] != 1.0:
        with pytest.warns(unimp.UnimpWarning, match="min_loss_scale"):
            imp = importers.jmp("params=float32,compute=float16,output=float32", kw)
    else:
        imp = importers.jmp("params=float32,compute=float16,output=float32", kw)
    finites = _finites(seed)
    assert trajectory(imp.policy.loss_scale, finites)[0] == _jmp(kw, finites)


@pytest.mark.parametrize("seed", range(3))
def test_imported_flax_replays_like_dynamic_scale(seed):
    rng = random.Random(seed)
    kw = {"growth_interval": rng.randint(1, 5), "scale": 2.0 ** rng.randint(-2, 20),
          "growth_factor": rng.choice([2.0, 4.0]), "backoff_factor": rng.choice([0.5, 0.25])}
    policy = importers.flax(**kw).policy
    finites = _finites(seed + 5)
    assert trajectory(policy.loss_scale, finites)[0] == _flax(kw, finites)


def test_exported_jmp_and_flax_replay_the_policy():
    finites = _finites(11)
    jmp_policy = unimp.load("jmp_float16").replace(loss_scale={"growth_interval": 3, "initial": 64.0})
    out = exporters.jmp(jmp_policy)
    assert out.unexpressed == ()
    assert _jmp(out.config["DynamicLossScale"], finites) == trajectory(jmp_policy.loss_scale, finites)[0]
    flax_policy = unimp.load("flax_dynamic_scale").replace(loss_scale={"growth_interval": 2, "initial": 8.0})
    out = exporters.flax(flax_policy)
    assert out.unexpressed == ()
    assert _flax(out.config, finites) == trajectory(flax_policy.loss_scale, finites)[0]


def test_jmp_export_lists_a_backoff_it_cannot_express():
    policy = unimp.load("jmp_float16").replace(loss_scale={"backoff_factor": 0.25})
    out = exporters.jmp(policy)
    assert [u for u in out.unexpressed if u.startswith("loss_scale.backoff_factor = 0.25")]
