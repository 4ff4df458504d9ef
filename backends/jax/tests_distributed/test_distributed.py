"""Data parallel over 2 XLA:CPU devices (shard_map) under one policy, nnx and linen.

- same global batch on 1 and 2 devices: same losses (stated tolerance), same scales and skips;
- an overflow on device 1 only: both devices skip, scales = the core's LossScale, params and
  optimizer state unchanged on the skipped step and identical on both devices at every step;
- ``distributed.reduce_dtype`` = bfloat16 / float16 really sums in that dtype (values from ml_dtypes,
  and the all-reduce in the compiled HLO has that element type).
"""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import unimp
from unimp.backend import UnimpWarning
from unimp.conformance.probe import probe_batches, probe_weights
from unimp.loss_scale import LossScale
from unimp_jax.distributed import agree, default_mesh
from unimp_jax.testing import LinenKit, NnxProbe, nll

ROOT = Path(__file__).resolve().parents[3]
STEPS = 6
# max relative loss difference 1 vs 2 devices measured over 6 Adam steps: mixed_fp16 1.7e-5, mixed_bf16
# 1.1e-4, pure_bf16 2.9e-4 (bf16 weight-gradient dots round per device half-batch vs the full batch)
LOSS_RTOL = 1e-3


def policy(name, **loss_scale):
    pol = unimp.load(name)
    # fp16: start at 1024 so the first step's fp16 backward is finite on 1 and on 2 devices (each
    # device's local mean gradient is larger than the global one, as with torch DDP), grow every 2 steps
    if pol.loss_scale.mode == "dynamic":
        pol = pol.replace(loss_scale={"initial": 1024.0, "growth_interval": 2, **loss_scale})
    return pol


def apply(pol, api):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)  # bf16/fp16 on XLA:CPU are slow: known
        if api == "nnx":
            return unimp.apply(pol, NnxProbe(probe_weights()), optax.adam(1e-2))
        probe = LinenKit().build_probe(probe_weights())
        return unimp.apply(pol, probe.module, optax.adam(1e-2), params=probe.params,
                           inputs=jnp.zeros((1, 1), jnp.int32))


class Runner:
    """One amp trained either by a plain jitted step (1 device) or by amp.data_parallel (2 devices)."""

    def __init__(self, pol, api, devices):
        self.amp, self.api, self.devices = apply(pol, api), api, devices
        axis = "data" if devices == 2 else None
        amp = self.amp
        if api == "nnx":
            def loss_fn(model, tokens, targets, poison):
                return self.loss(model(tokens), targets, poison)

            grad_fn = amp.value_and_grad(loss_fn, axis_name=axis)

            def body(model, optimizer, tokens, targets, poison):
                loss, grads, finite = grad_fn(optimizer, model, tokens, targets, poison)
                optimizer.update(model, grads)
                return loss, finite

            self._step = amp.data_parallel(body) if axis else nnx.jit(body)
        else:
            def loss_fn(params, tokens, targets, poison):
                return self.loss(amp.apply(params, tokens), targets, poison)

            grad_fn = amp.value_and_grad(loss_fn, axis_name=axis)

            def body(params, opt_state, tokens, targets, poison):
                loss, grads, finite = grad_fn(opt_state, params, tokens, targets, poison)
                updates, opt_state = amp.optimizer.update(grads, opt_state, params)
                return amp.apply_updates(params, updates, opt_state), opt_state, loss, finite

            self._step = amp.data_parallel(body) if axis else jax.jit(body)

    @staticmethod
    def loss(logp, targets, poison):
        # poison: one bool per example; a poisoned example makes its device's loss (and grads) inf
        per_example = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0].mean(-1)
        return (per_example * jnp.where(poison, jnp.inf, 1.0)).mean()

    def step(self, batch, poison):
        args = (jnp.asarray(batch.tokens), jnp.asarray(batch.targets), jnp.asarray(poison))
        if self.api == "nnx":
            loss, finite = self._step(self.amp.model, self.amp.optimizer, *args)
        else:
            self.amp.params, self.amp.opt_state, loss, finite = self._step(self.amp.params, self.amp.opt_state,
                                                                           *args)
        return loss, finite

    def state(self):
        """Every param and optimizer-state leaf as numpy, per device: {path: [device arrays]}."""
        if self.api == "nnx":
            tree = nnx.state((self.amp.model, self.amp.optimizer))
        else:
            tree = (self.amp.params, self.amp.opt_state)
        out = {}
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            shards = sorted(leaf.addressable_shards, key=lambda s: s.device.id)
            out[jax.tree_util.keystr(path)] = [np.asarray(s.data) for s in shards]
        return out


def _bits(x):
    """Raw bits of floating arrays (so NaNs compare, and -0.0 != 0.0); others as they are."""
    x = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])
    return x


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("name", ["mixed_fp16", "mixed_bf16", "pure_bf16"])
def test_two_devices_match_one_device_with_the_same_global_batch(api, name):
    pol = policy(name)
    one, two = Runner(pol, api, 1), Runner(pol, api, 2)
    batches = probe_batches(STEPS)
    assert batches[0].tokens.shape[0] % 2 == 0
    clean = np.zeros(batches[0].tokens.shape[0], bool)
    for i, batch in enumerate(batches):
        l1, f1 = one.step(batch, clean)
        l2, f2 = two.step(batch, clean)
        assert bool(f1) and bool(f2)
        assert abs(float(l2) - float(l1)) <= LOSS_RTOL * abs(float(l1)), (i, float(l1), float(l2))
        assert one.amp.loss_scale_state() == two.amp.loss_scale_state()
    if pol.loss_scale.mode == "dynamic":
        assert two.amp.scale == 1024.0 * 2 ** (STEPS // 2)  # it really grew, on both
    # the loss fell (it trains), and the two runs did not drift apart
    assert float(l2) < float(two.step(batches[0], clean)[0]) + 1.0
    for path, per_device in two.state().items():  # replicated state is identical on both devices
        np.testing.assert_array_equal(_bits(per_device[0]), _bits(per_device[1]), err_msg=path)


POISON = [False, False, True, False, True, True, False, False]  # steps whose device-1 half overflows


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("name", ["mixed_fp16", "pure_bf16"])
def test_overflow_on_one_device_skips_the_step_on_every_device(api, name):
    pol = policy(name, hysteresis=2) if name == "mixed_fp16" else policy(name).replace(
        loss_scale={"mode": "dynamic", "skip_nonfinite": True, "initial": 256.0, "growth_interval": 2})
    run = Runner(pol, api, 2)
    reference, ref_state = LossScale(pol.loss_scale), LossScale(pol.loss_scale).initial_state()
    batches = probe_batches(len(POISON))
    B = batches[0].tokens.shape[0]
    for i, (batch, bad) in enumerate(zip(batches, POISON)):
        poison = np.zeros(B, bool)
        poison[B - 1] = bad  # the last example lives on device 1 (rows B/2.. of the split batch)
        before = run.state()
        loss, finite = run.step(batch, poison)
        after = run.state()
        flags = [bool(s.data) for s in finite.addressable_shards]
        assert flags == [not bad, not bad], (i, flags)
        assert bool(np.isfinite(float(loss))) == (not bad)  # the loss is the mean over both devices
        ref_state = reference.update(ref_state, not bad).state
        assert run.amp.loss_scale_state() == ref_state, i
        for path, per_device in after.items():
            np.testing.assert_array_equal(_bits(per_device[0]), _bits(per_device[1]), err_msg=f"step {i} {path}")
            if bad and "loss_scale" not in path:  # params, masters, Adam moments and counters untouched
                np.testing.assert_array_equal(_bits(per_device[0]), _bits(before[path][0]),
                                              err_msg=f"step {i} {path}")
        if not bad:
            changed = [p for p in after if "loss_scale" not in p
                       and not np.array_equal(_bits(after[p][0]), _bits(before[p][0]))]
            assert changed, i
    assert run.amp.skipped_steps == sum(POISON)
    if api == "nnx":
        assert int(run.amp.optimizer.step.get_value()) == POISON.count(False)


def test_agree_is_an_and_over_the_devices():
    mesh = default_mesh("data")
    flags = jax.device_put(jnp.asarray([True, False]), NamedSharding(mesh, P("data")))
    agreed = jax.jit(jax.shard_map(lambda f: agree(f[0], "data"), mesh=mesh, in_specs=P("data"),
                                   out_specs=P()))(flags)
    assert [bool(s.data) for s in agreed.addressable_shards] == [False, False]


# -------------------------------------------------------------------------------- reduce dtype
G0, G1 = 1.0, 2.0 ** -9  # per-device gradients, both exact in bf16; their mean is not (bf16 ulp at 0.5: 2**-8)
EXPECTED_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def expected_mean(reduce_dtype, scale):
    """The 2-device mean as unimp defines it: each device's scaled grad in reduce_dtype, halved, summed."""
    t = EXPECTED_DTYPES[reduce_dtype]
    a, b = np.asarray([G0 * scale], t) / t(2), np.asarray([G1 * scale], t) / t(2)
    return float(np.float32((a + b)[0])) / scale


class Linear1(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(1, 1, use_bias=False, rngs=nnx.Rngs(0))
        self.fc.kernel.set_value(jnp.ones((1, 1), jnp.float32))

    def __call__(self, x):
        return self.fc(x)


@pytest.mark.parametrize("reduce_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("name", ["fp32", "mixed_fp16"])
def test_reduce_dtype_is_the_dtype_of_the_sum(name, reduce_dtype):
    pol = policy(name).replace(distributed={"reduce_dtype": reduce_dtype}, layout={"on_misaligned": "ignore"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply(pol, Linear1(), optax.sgd(1.0))
    grad_fn = amp.value_and_grad(lambda m, x: m(x).astype(jnp.float32).mean(), axis_name="data")

    def body(model, optimizer, x):
        _loss, grads, finite = grad_fn(optimizer, model, x)
        optimizer.update(model, grads)
        return grads["fc"]["kernel"].get_value()[0, 0], finite

    step = amp.data_parallel(body)
    x = jnp.asarray([[G0], [G1]], jnp.float32)  # device 0 sees G0, device 1 sees G1: d loss / d kernel = x
    grad, finite = step(amp.model, amp.optimizer, x)
    scale = 1.0 if pol.loss_scale.mode == "none" else pol.loss_scale.initial
    want = expected_mean(reduce_dtype, scale)
    got = [float(s.data) for s in grad.addressable_shards]
    assert got == [want, want] and bool(finite)
    np.testing.assert_array_equal(np.asarray(amp.model.fc.kernel.get_value()), [[np.float32(1.0 - want)]])
    if reduce_dtype == "float32":
        assert want == (G0 + G1) / 2
    elif reduce_dtype == "bfloat16":
        assert want == 0.5  # the bf16 sum rounded 0.5 + 2**-10 to 0.5
    else:
        assert want == (G0 + G1) / 2  # exact in float16 (ulp at 0.5: 2**-11)

    # and the program unimp emits all-reduces in that dtype (XLA:CPU then runs a bf16/f16 all-reduce as
    # convert -> f32 sum -> convert back: for 2 devices the same rounding as one bf16/f16 add, checked above)
    graphdef, state = nnx.split((amp.model, amp.optimizer))
    mesh = default_mesh("data")

    def pure(state, x):
        m, o = nnx.merge(graphdef, state)
        return body(m, o, x)[0]

    text = jax.jit(jax.shard_map(pure, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())).lower(
        jax.device_put(state, NamedSharding(mesh, P())),
        jax.device_put(x, NamedSharding(mesh, P("data")))).as_text()
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[reduce_dtype]
    operand_types = re.findall(r'"stablehlo.all_reduce".*?\}\) : \((.*?)\) ->', text, re.S)
    assert f"tensor<1x1x{short}>" in operand_types, operand_types


def test_plain_jit_spmd_reduces_in_whatever_dtype_xla_picks():
    """Why unimp's distributed path is shard_map: jit + NamedSharding alone ignores reduce_dtype."""
    pol = policy("mixed_bf16").replace(layout={"on_misaligned": "ignore"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply(pol, nnx.Linear(16, 16, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    graphdef, state = nnx.split(amp.model)
    grad_fn = jax.grad(lambda s, x: nnx.merge(graphdef, s)(x).astype(jnp.float32).mean())
    mesh = default_mesh("data")
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data")))
    hlo = jax.jit(grad_fn).lower(jax.device_put(state, NamedSharding(mesh, P())), x).compile().as_text()
    kernel_reduces = [line for line in hlo.splitlines()
                      if ("all-reduce(" in line or "all-reduce-start(" in line) and "[16,16]" in line]
    # the partitioner all-reduces the kernel gradient's dot output, which is bfloat16 (the layer's compute
    # dtype), although the policy's reduce_dtype is float32 (XLA:CPU then runs that bf16 all-reduce
    # "_promoted": convert -> f32 sum -> convert back; GPUs reduce bf16 natively)
    assert kernel_reduces and all("bf16[16,16]" in r or "_promoted" in r for r in kernel_reduces), kernel_reduces
    assert pol.distributed.reduce_dtype == "float32"


def test_data_parallel_refuses_a_batch_it_cannot_split():
    amp = apply(policy("fp32"), "nnx")
    grad_fn = amp.value_and_grad(lambda m, t, y: nll(m(t), y), axis_name="data")

    def body(model, optimizer, tokens, targets):
        loss, grads, _ = grad_fn(optimizer, model, tokens, targets)
        optimizer.update(model, grads)
        return loss

    step = amp.data_parallel(body)
    odd = jnp.zeros((3, 8), jnp.int32)
    with pytest.raises(ValueError, match="divisible by the 2 devices"):
        step(amp.model, amp.optimizer, odd, odd)
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        amp.data_parallel(body, mesh=default_mesh("data"), axis_name="batch")


def test_example_runs():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_sharded.py"), "--steps", "6"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped on both devices" in out.stdout, out.stdout



def test_has_aux_gives_the_mean_loss_and_per_device_aux():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        amp = unimp.apply(policy("fp32").replace(layout={"on_misaligned": "ignore"}), Linear1(), optax.sgd(0.0))
    grad_fn = amp.value_and_grad(lambda m, x: (m(x).mean(), x[:, 0]), has_aux=True, axis_name="data")

    def body(model, optimizer, x):
        (loss, aux), grads, _ = grad_fn(optimizer, model, x)
        optimizer.update(model, grads)
        return loss, aux

    step = amp.data_parallel(body, out_specs=(P(), P("data")))
    loss, aux = step(amp.model, amp.optimizer, jnp.asarray([[2.0], [4.0]]))
    assert [float(s.data) for s in loss.addressable_shards] == [3.0, 3.0]  # mean of the device losses 2, 4
    np.testing.assert_array_equal(np.asarray(aux), [2.0, 4.0])
