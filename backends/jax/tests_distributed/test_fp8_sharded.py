"""Delayed FP8 scaling in a data-parallel step (shard_map over 2 XLA:CPU devices), nnx and linen.

Each device sees a different half batch (device 1's activations and targets 8x larger); after every
step the delayed-scaling state is bitwise identical on both devices and equals the state built, by
Transformer Engine's rule, from the *global* amax: the max over the two devices' amaxes, computed here
from each device's half batch in numpy (bf16 casts from ml_dtypes).

The loss is linear in the FP8 layer's output, ``mean(y * t)``, so the output gradient each device
quantizes is ``t_local / (rows * features)``, known without running the layer.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import unimp
from unimp_jax import fp8

pytestmark = pytest.mark.filterwarnings("ignore::unimp.UnimpWarning")  # bf16 on XLA:CPU

STEPS, ROWS, K, N = 3, 8, 32, 16  # ROWS per step (4 per device), power-of-2 sizes: exact means
HISTORY = unimp.load("fp8_delayed").fp8.amax_history
BF16 = ml_dtypes.bfloat16


class NnxOne(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(K, N, rngs=rngs)

    def __call__(self, x):
        return self.fc(x)


class LinenOne(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(N, name="fc")(x)


def batches():
    """Per step (x, t); rows ROWS/2.. (device 1) 8x larger, so the devices' amaxes differ."""
    rng = np.random.default_rng(0)
    big = np.repeat([1.0, 8.0], ROWS // 2)[:, None].astype(np.float32)
    out = []
    for _ in range(STEPS):
        x = (rng.standard_normal((ROWS, K)) * big).astype(BF16).astype(np.float32)  # exact in bf16
        t = (rng.standard_normal((ROWS, N)) * big).astype(BF16).astype(np.float32)
        out.append((x, t))
    return out


def loss_fn(out, t):
    return (out.astype(jnp.float32) * t).mean()


def build(api):
    policy = unimp.load("fp8_delayed")
    if api == "nnx":
        amp = unimp.apply(policy, NnxOne(nnx.Rngs(0)), optax.sgd(0.5))
        grad_fn = amp.value_and_grad(lambda m, x, t: loss_fn(m(x), t), axis_name="data")

        def body(model, opt, x, t):
            loss, grads, _ = grad_fn(opt, model, x, t)
            opt.update(model, grads)
            return loss

        dp = amp.data_parallel(body)

        def step(x, t):
            return dp(amp.model, amp.optimizer, x, t)

        def kernel():
            return np.asarray(amp.model.fc.kernel[...])
    else:
        module = LinenOne()
        amp = unimp.apply(policy, module, optax.sgd(0.5),
                          params=module.init(jax.random.key(0), jnp.zeros((1, K)))["params"], inputs=jnp.zeros((1, K)))
        grad_fn = amp.value_and_grad(lambda p, x, t: loss_fn(amp.apply(p, x), t), axis_name="data")

        def body(params, opt_state, x, t):
            loss, grads, _ = grad_fn(opt_state, params, x, t)
            updates, opt_state = amp.optimizer.update(grads, opt_state, params)
            return amp.apply_updates(params, updates, opt_state), opt_state, loss

        dp = amp.data_parallel(body)

        def step(x, t):
            amp.params, amp.opt_state, loss = dp(amp.params, amp.opt_state, x, t)
            return loss

        def kernel():
            return np.asarray(fp8.split(amp.params)[0]["fc"]["kernel"])
    return amp, step, kernel


def per_device_state(amp):
    """{"fc.input_scale": [device 0 array, device 1 array], ...} of the delayed-scaling state."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(amp.fp8_state()):
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        name = ".".join(k for k in keys if k not in (fp8.NNX_ATTR, fp8.OWG, "value"))
        out[name] = [np.asarray(s.data) for s in sorted(leaf.addressable_shards, key=lambda s: s.device.id)]
    return out


def te_scale(history, scale, fmax):
    """Transformer Engine's delayed scale (the rule Flax's fp8_ops implements): amax of the history
    before this step's entry over the format max; the old scale while that amax is 0."""
    amax = np.max(history)
    return np.float32(1.0) / (np.float32(fmax) / amax) if amax > 0 else scale


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_delayed_state_is_agreed_across_devices(api):
    assert jax.device_count() == 2
    amp, step, kernel = build(api)
    fmax = {"input": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
            "kernel": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
            "output_grad": float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}
    hist = {k: np.zeros(HISTORY, np.float32) for k in fmax}
    scale = {k: np.ones(1, np.float32) for k in fmax}
    half = ROWS // 2
    for i, (x, t) in enumerate(batches()):
        w = kernel().astype(BF16).astype(np.float32)  # the replicated kernel, as the bf16 layer sees it
        local = {  # each device's own amax, from its half batch
            "input": [np.abs(x[:half]).max(), np.abs(x[half:]).max()],
            "kernel": [np.abs(w).max()] * 2,
            "output_grad": [np.float32(np.abs(tt).max() / (half * N)).astype(BF16).astype(np.float32)
                            for tt in (t[:half], t[half:])],
        }
        assert local["input"][1] > local["input"][0] and local["output_grad"][1] > local["output_grad"][0]
        step(jnp.asarray(x), jnp.asarray(t))
        state = per_device_state(amp)
        for k in fmax:
            scale[k] = np.asarray(te_scale(hist[k], scale[k], fmax[k]), np.float32).reshape(1)
            hist[k] = np.roll(hist[k], -1)
            hist[k][0] = max(local[k])  # the global amax: the max over the devices
            for name, want in ((f"fc.{k}_amax_history", hist[k]), (f"fc.{k}_scale", scale[k])):
                d0, d1 = state[name]
                np.testing.assert_array_equal(d0, d1, err_msg=f"step {i} {name}: devices differ")
                np.testing.assert_allclose(d0, want, rtol=1e-6, err_msg=f"step {i} {name}")
    assert state["fc.input_scale"][0][0] != 1.0  # the delayed scale did move
    amp.remove()


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(32, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


LOSS_RTOL = 0.02  # measured: at most 5.2e-3 relative over 6 Adam steps (bf16 partial sums per half batch)


def test_delayed_sharded_loss_matches_one_device_on_the_full_batch():
    x = jax.random.normal(jax.random.key(1), (16, 32)) * jnp.repeat(jnp.asarray([1.0, 8.0]), 8)[:, None]
    y = jax.random.normal(jax.random.key(2), (16, 16))

    def loss(m, x, y):
        return ((m(x).astype(jnp.float32) - y) ** 2).mean()

    runs = []
    for axis in (None, "data"):
        amp = unimp.apply("fp8_delayed", NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
        grad_fn = amp.value_and_grad(loss, axis_name=axis)

        def body(model, opt, x, y, grad_fn=grad_fn):
            value, grads, _ = grad_fn(opt, model, x, y)
            opt.update(model, grads)
            return value

        step = amp.data_parallel(body) if axis else nnx.jit(body)
        runs.append([float(step(amp.model, amp.optimizer, x, y)) for _ in range(6)])
        amp.remove()
    one, two = runs
    assert one[-1] < 0.7 * one[0]
    for a, b in zip(one, two):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (one, two)
