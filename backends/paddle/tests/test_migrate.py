"""`unimp import/export` against Paddle's real GradScaler rule: built from the same arguments it
replays the imported policy's reference trajectory; built from an export, the policy's."""

import random
import sys

import numpy as np
import paddle
import pytest

import unimp
from unimp.loss_scale import trajectory
from unimp.migrate import exporters, importers


def _finites(seed, n=80, p_bad=0.3):
    rng = random.Random(seed)
    return [rng.random() > p_bad for _ in range(n)]


def _gradscaler(kw, finites):
    """paddle.amp.GradScaler(**kw) driven through its own ``_update``. On CPU GradScaler disables
    itself in __init__; we set the fields its __init__ sets when enabled (as test_loss_scale does)."""
    s = paddle.amp.GradScaler(**kw)
    s._enable, s._use_dynamic_loss_scaling = True, True
    s._init_loss_scaling, s._incr_ratio, s._decr_ratio = kw["init_loss_scaling"], kw["incr_ratio"], kw["decr_ratio"]
    s._incr_every_n_steps, s._decr_every_n_nan_or_inf = kw["incr_every_n_steps"], kw["decr_every_n_nan_or_inf"]
    s._incr_count = s._decr_count = 0
    s._scale = paddle.to_tensor(np.float32(kw["init_loss_scaling"]))
    out = []
    for f in finites:
        s._cache_found_inf = not f
        s._update()
        out.append(float(s._scale.numpy()))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_imported_gradscaler_replays_like_paddle(seed):
    rng = random.Random(seed)
    kw = {"init_loss_scaling": 2.0 ** rng.randint(0, 20), "incr_ratio": 2.0, "decr_ratio": rng.choice([0.5, 0.25]),
          "incr_every_n_steps": rng.randint(1, 4), "decr_every_n_nan_or_inf": rng.randint(1, 3)}
    policy = importers.paddle({"level": "O1"}, kw).policy
    finites = _finites(seed)
    assert trajectory(policy.loss_scale, finites)[0] == _gradscaler(kw, finites)


def test_exported_gradscaler_replays_the_policy():
    policy = unimp.load("paddle_o1").replace(loss_scale={"initial": 512.0, "growth_interval": 2, "hysteresis": 2})
    out = exporters.paddle(policy)
    assert out.unexpressed == ()
    kw = {k: v for k, v in out.config["GradScaler"].items() if k != "use_dynamic_loss_scaling"}
    finites = _finites(5)
    assert _gradscaler(kw, finites) == trajectory(policy.loss_scale, finites)[0]


def test_custom_lists_round_trip_through_auto_cast():
    """The exported custom lists, given to the real auto_cast, are what Paddle's tracer holds; and
    importing them back moves the same canonical ops. A list naming only part of a canonical op (one of
    matmul's Paddle op types) is refused, never widened to the whole op."""
    from unimp.migrate.paddle import paddle_names

    with pytest.raises(unimp.UnsupportedError, match="matmul_v2 is only part of canonical op 'matmul'"):
        importers.paddle({"level": "O1", "custom_black_list": ["matmul_v2"]})
    matmul = list(paddle_names()["matmul"])
    imp = importers.paddle({"level": "O1", "custom_white_list": ["softmax"], "custom_black_list": matmul})
    assert imp.policy.ops.category("softmax") == "lower" and imp.policy.ops.category("matmul") == "float32"
    out = exporters.paddle(imp.policy)
    ac = out.config["auto_cast"]
    assert "softmax" in ac["custom_white_list"] and set(matmul) <= set(ac["custom_black_list"])
    update_list = sys.modules["paddle.amp.auto_cast"]._update_list
    white, black = update_list(ac["custom_white_list"], ac["custom_black_list"], "O1", "float16")
    assert "softmax" in white and set(matmul) <= set(black) and not set(matmul) & set(white)
    assert importers.paddle(ac).policy.ops == imp.policy.ops


def _static_kernel(cfg, finites):
    """Paddle's static-graph update_loss_scaling op (what fleet amp_configs trains with) on CPU."""
    x = [paddle.ones([2])]
    scale = paddle.to_tensor(np.array([cfg["init_loss_scaling"]], np.float32))
    good, bad = paddle.zeros([1], "int32"), paddle.zeros([1], "int32")
    out = []
    for f in finites:
        paddle._C_ops.update_loss_scaling_(x, paddle.to_tensor([not f]), scale, good, bad, cfg["incr_every_n_steps"],
                                           cfg["decr_every_n_nan_or_inf"], cfg["incr_ratio"], cfg["decr_ratio"], False)
        out.append(float(scale.numpy()[0]))
    return out


@pytest.mark.parametrize("seed", range(2))
def test_imported_amp_configs_replay_like_the_static_kernel(seed):
    rng = random.Random(seed)
    cfg = {"init_loss_scaling": 2.0 ** rng.randint(0, 6), "incr_ratio": 2.0, "decr_ratio": 0.5,
           "incr_every_n_steps": rng.randint(1, 4), "decr_every_n_nan_or_inf": rng.randint(1, 3)}
    policy = importers.paddle_amp_configs(cfg).policy
    finites = _finites(seed + 20, p_bad=0.45)
    assert trajectory(policy.loss_scale, finites)[0] == _static_kernel(cfg, finites)


def test_imported_amp_configs_defaults_replay_like_the_static_kernel():
    """fleet's defaults (decr_ratio 0.8 is a float32 proto field) through the real kernel."""
    policy = importers.paddle_amp_configs({"incr_every_n_steps": 2}).policy
    ls = policy.loss_scale
    cfg = {"init_loss_scaling": ls.initial, "incr_ratio": ls.growth_factor, "decr_ratio": ls.backoff_factor,
           "incr_every_n_steps": 2, "decr_every_n_nan_or_inf": ls.hysteresis}
    assert (ls.initial, ls.hysteresis, np.float32(ls.backoff_factor)) == (32768.0, 2, np.float32(0.8))
    finites = _finites(30, n=120, p_bad=0.5)
    assert trajectory(ls, finites)[0] == _static_kernel(cfg, finites)
