"""FP8 ``rowwise`` / ``rowwise_gw_hp`` on XLA (emulated on CPU), torchao's recipes of the same names.

Numerics: the FP8 dot's output and gradients equal an independent numpy reference (ml_dtypes e4m3,
scales per row / per column, dequantized, float32 matmul) to float32 rounding (rtol 1e-5 of the
largest value). Training: after 20 Adam steps the loss is within 10% of bf16's (as for the other
recipes in test_fp8.py; e4m3 keeps 3 mantissa bits). Measured: nnx rowwise 1.7%, rowwise_gw_hp 2.0%;
linen rowwise 4.4%, rowwise_gw_hp 0.1%.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from fp8_models import LinenMLP, NnxMLP

import unimp
from unimp_jax import fp8
from unimp_jax.plan import fp8_support

pytestmark = pytest.mark.filterwarnings("ignore::unimp.UnimpWarning")  # bf16 on XLA:CPU, the misaligned head

E4M3 = ml_dtypes.float8_e4m3fn
FMAX = float(ml_dtypes.finfo(E4M3).max)  # 448
DN = (((1,), (0,)), ((), ()))  # x (M, K) . w (K, N)
RTOL = 1e-5


# ------------------------------------------------------------------ the numpy reference
def qdq(a, axis, pow2):
    """``a`` through e4m3 with one scale per slice along ``axis`` (None: the whole tensor), back in float32.

    scale = amax / 448 (torchao: multiplier 448 / amax; ``pow2``: that multiplier rounded down to 2**k).
    """
    a = np.asarray(a, np.float32)
    amax = np.max(np.abs(a), axis=axis, keepdims=True)
    if pow2:
        mult = np.exp2(np.floor(np.log2(np.float32(FMAX) / amax))).astype(np.float32)
        return np.clip(a * mult, -FMAX, FMAX).astype(E4M3).astype(np.float32) / mult
    scale = (amax / np.float32(FMAX)).astype(np.float32)
    return np.clip(a / scale, -FMAX, FMAX).astype(E4M3).astype(np.float32) * scale


def reference(recipe, x, w, g):
    """(y, dx, dw) of y = x . w with cotangent g, every GEMM as torchao's recipe quantizes it."""
    if recipe == "rowwise":  # every operand per row of its GEMM (amax over the contracted dim), 2**k scales
        y = qdq(x, 1, True) @ qdq(w, 0, True)
        dx = qdq(g, 1, True) @ qdq(w, 1, True).T
        dw = qdq(x, 0, True).T @ qdq(g, 0, True)
    else:  # rowwise_gw_hp: forward per row; dx: g per row, w per tensor; dw in high precision
        y = qdq(x, 1, False) @ qdq(w, 0, False)
        dx = qdq(g, 1, False) @ qdq(w, None, False).T
        dw = np.asarray(x, np.float32).T @ np.asarray(g, np.float32)
    return y, dx, dw


def operands():
    rng = np.random.default_rng(0)
    # rows of x and g spanning 6 decades: one scale per tensor would flush the small rows to zero
    x = rng.standard_normal((8, 32)).astype(np.float32) * np.logspace(-3, 3, 8, dtype=np.float32)[:, None]
    w = rng.standard_normal((32, 16)).astype(np.float32) * np.logspace(-2, 2, 16, dtype=np.float32)[None, :]
    g = rng.standard_normal((8, 16)).astype(np.float32) * np.logspace(2, -3, 8, dtype=np.float32)[:, None]
    return x, w, g


def close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max(), err_msg=what)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_gw_hp"])
def test_dot_and_gradients_match_the_numpy_reference(recipe):
    x, w, g = operands()
    dot = fp8.dot_general_for(recipe, "float8_e4m3fn", "float8_e4m3fn")
    y, vjp = jax.vjp(lambda a, b: dot(a, b, DN), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    ry, rdx, rdw = reference(recipe, x, w, g)
    close(y, ry, "y")
    close(dx, rdx, "dx")
    close(dw, rdw, "dw")
    # per-row scaling really is needed here: the tensorwise dot misses the small rows
    ty = fp8.dot_general_for("tensorwise", "float8_e4m3fn", "float8_e4m3fn")(jnp.asarray(x), jnp.asarray(w), DN)
    assert not np.allclose(np.asarray(ty), ry, rtol=1e-2, atol=1e-2 * np.abs(ry).max())


def test_gradients_through_jax_grad_match_the_reference():
    """jax.grad of a scalar loss: its cotangent g = 2 y, then dx, dw as the rowwise reference."""
    x, w, _ = operands()
    dot = fp8.dot_general_for("rowwise", "float8_e4m3fn", "float8_e4m3fn")
    dx, dw = jax.grad(lambda a, b: (dot(a, b, DN) ** 2).sum(), (0, 1))(jnp.asarray(x), jnp.asarray(w))
    y = reference("rowwise", x, w, np.ones((8, 16), np.float32))[0]
    _, rdx, rdw = reference("rowwise", x, w, 2 * y)
    close(dx, rdx, "dx")
    close(dw, rdw, "dw")


def test_batched_dims_keep_their_own_scales():
    """A 3-D activation (batch, seq, K): each (batch, seq) row has its own scale, as the 2-D reference."""
    x, w, g = operands()
    dot = fp8.dot_general_for("rowwise", "float8_e4m3fn", "float8_e4m3fn")
    x3, g3 = x.reshape(2, 4, 32), g.reshape(2, 4, 16)
    y, vjp = jax.vjp(lambda a, b: dot(a, b, (((2,), (0,)), ((), ()))), jnp.asarray(x3), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g3))
    ry, rdx, rdw = reference("rowwise", x, w, g)
    close(np.asarray(y).reshape(8, 16), ry, "y")
    close(np.asarray(dx).reshape(8, 32), rdx, "dx")
    close(dw, rdw, "dw")


# ------------------------------------------------------------------ the Plan and real training steps
def test_the_plan_runs_the_rowwise_presets_on_jax():
    assert set(fp8_support("cpu").recipes) == set(fp8.RECIPES) >= {"rowwise", "rowwise_gw_hp"}
    for recipe in ("rowwise", "rowwise_gw_hp"):
        policy = unimp.load("fp8_rowwise").replace(fp8={"recipe": recipe})
        plan = unimp.get_backend("jax").compile(policy)
        assert plan.fp8.active and plan.fp8.recipe == recipe and not plan.fp8.fallback
        assert any(f"recipe {recipe}" in line for line in plan.fp8.describe())


X = jax.random.normal(jax.random.key(1), (32, 32))
Y = jax.random.normal(jax.random.key(2), (32, 10))
STEPS, TOL = 20, 0.10  # FP8: not derived, kept as is (issue 27); see the module docstring


def loss_of(out):
    return ((out.astype(jnp.float32) - Y) ** 2).mean()


def run_nnx(policy):
    amp = unimp.apply(policy, NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))

    @nnx.jit
    def step(model, opt, x):
        loss, grads, _ = amp.value_and_grad(lambda m, x: loss_of(m(x)))(opt, model, x)
        opt.update(model, grads)
        return loss

    return amp, [float(step(amp.model, amp.optimizer, X)) for _ in range(STEPS)]


def run_linen(policy):
    module = LinenMLP()
    amp = unimp.apply(policy, module, optax.adam(1e-2), params=module.init(jax.random.key(0), X)["params"],
                      inputs=X)

    @jax.jit
    def step(params, opt_state, x):
        loss, grads, _ = amp.value_and_grad(lambda p: loss_of(amp.apply(p, x)))(opt_state, params)
        updates, opt_state = amp.optimizer.update(grads, opt_state, params)
        return amp.apply_updates(params, updates, opt_state), opt_state, loss

    losses = []
    for _ in range(STEPS):
        amp.params, amp.opt_state, loss = step(amp.params, amp.opt_state, X)
        losses.append(float(loss))
    return amp, losses


RUNS = {"nnx": run_nnx, "linen": run_linen}


@pytest.fixture(scope="module")
def bf16_losses():
    out = {}
    for api, run in RUNS.items():
        amp, out[api] = run("mixed_bf16")
        amp.remove()
    return out


@pytest.mark.parametrize(("api", "recipe"), [("nnx", "rowwise"), ("linen", "rowwise"), ("nnx", "rowwise_gw_hp")])
def test_training_step_converges_close_to_bf16(api, recipe, bf16_losses):
    bf16 = bf16_losses[api]
    amp, losses = RUNS[api](unimp.load("fp8_rowwise").replace(fp8={"recipe": recipe}))
    rows = {r.path: r.fp8 for r in amp.report(*([X] if api == "nnx" else [])).rows}
    assert rows == {"fc1": recipe, "fc2": recipe, "head": None}
    assert losses[-1] < 0.7 * losses[0]
    assert abs(losses[-1] - bf16[-1]) <= TOL * bf16[-1], (losses[-1], bf16[-1])
    assert losses != bf16  # FP8 numerics, not the bf16 run again
    amp.remove()


def test_rowwise_step_multiplies_e4m3_operands_only():
    """fp8_rowwise: e4m3 for activations, weights and gradients (no e5m2 anywhere in the step)."""
    amp = unimp.apply("fp8_rowwise", NnxMLP(nnx.Rngs(0)), optax.adam(1e-2))
    graphdef, state = nnx.split((amp.model, amp.optimizer))

    def pure(state, x):
        model, opt = nnx.merge(graphdef, state)
        loss, grads, _ = amp.value_and_grad(lambda m, x: loss_of(m(x)))(opt, model, x)
        opt.update(model, grads)
        return loss, nnx.state((model, opt))

    hlo = jax.jit(pure).lower(state, X).as_text()
    assert "f8E4M3FN" in hlo and "f8E5M2" not in hlo
    amp.remove()
