"""`unimp import/export` against Keras 3's real LossScaleOptimizer: built from the same arguments
it replays the imported policy's reference trajectory; built from an export, the policy's."""

import random

import keras
import pytest
from keras_steps import replay_scales

import unimp
from unimp.loss_scale import trajectory
from unimp.migrate import exporters, importers


def _finites(seed, n=60, p_bad=0.25):
    rng = random.Random(seed)
    return [rng.random() > p_bad for _ in range(n)]


def _keras(kw, finites):
    return replay_scales(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.0), **kw), finites)


@pytest.mark.parametrize("seed", range(2))
def test_imported_loss_scale_optimizer_replays_like_keras(seed):
    rng = random.Random(seed)
    kw = {"initial_scale": 2.0 ** rng.randint(0, 20), "dynamic_growth_steps": rng.randint(1, 4)}
    policy = importers.keras("mixed_float16", kw).policy
    finites = _finites(seed)
    assert trajectory(policy.loss_scale, finites)[0] == _keras(kw, finites)


def test_exported_loss_scale_optimizer_replays_the_policy():
    policy = unimp.load("keras_mixed_float16").replace(loss_scale={"initial": 256.0, "growth_interval": 2})
    out = exporters.keras(policy)
    assert out.unexpressed == () and out.config["policy"] == "mixed_float16"
    finites = _finites(3)
    assert _keras(out.config["LossScaleOptimizer"], finites) == trajectory(policy.loss_scale, finites)[0]
