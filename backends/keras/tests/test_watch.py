"""``amp.watch()`` on Keras (every Keras backend): records of real ``fit`` / ``train_on_batch`` steps.

Expected values come from outside the watch: the layers' outputs fetched by a functional sub-model and
classified with NumPy's own ``finfo``; a planted overflow whose layer and pass the test knows; the weights
of the same training run without a watch.
"""

import copy
import warnings

import keras
import numpy as np
import pytest

import unimp
from unimp.errors import UnsupportedError

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", unimp.UnimpWarning)  # the tiny layers' alignment findings
        yield


class Amplify(keras.layers.Layer):
    """Identity in the forward; its backward multiplies the gradient by 1e30 (inf in float16): a custom op
    of each Keras backend's own (Keras has no cross-backend custom gradient on torch)."""

    def call(self, x):
        if BACKEND == "tensorflow":
            import tensorflow as tf

            @tf.custom_gradient
            def amplify(x):
                return tf.identity(x), lambda g: g * tf.cast(1e30, g.dtype)

            return amplify(x)
        if BACKEND == "jax":
            import jax

            @jax.custom_vjp
            def amplify(x):
                return x

            amplify.defvjp(lambda x: (x, None), lambda _, g: (g * jax.numpy.asarray(1e30, g.dtype),))
            return amplify(x)
        import torch

        class Amplified(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return g * 1e30

        return Amplified.apply(x)


def mlp(seed: int = 0, middle: keras.layers.Layer | None = None) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu", name="fc1")(x)
    h = (middle or keras.layers.Dense(16, name="mid"))(h)
    out = keras.layers.Dense(1, name="head")(h)
    return keras.Model(x, out)


def data(n: int = 32, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def small() -> tuple[np.ndarray, np.ndarray]:
    """A batch whose scaled gradients stay finite in float16 (the planted op is the only overflow)."""
    x, y = data(16)
    return x * 0.01, y * 0.0


def applied(policy: str, model: keras.Model, **watch):
    amp = unimp.apply(policy, model, keras.optimizers.SGD(1e-3))
    model.compile(optimizer=amp.optimizer, loss="mse")
    return amp, amp.watch(**watch)


def native_classes(t: np.ndarray) -> dict[str, float]:
    """amax and class fractions of a float16 tensor by NumPy's finfo (no unimp code)."""
    a = np.abs(t.astype(np.float32))
    tiny = np.finfo(np.float16).tiny
    return {"amax": float(a[np.isfinite(a)].max()), "zero": float(np.mean(a == 0)),
            "subnormal": float(np.mean((a > 0) & (a < tiny))), "overflow": float(np.mean(np.isinf(a))),
            "nonfinite": float(np.mean(~np.isfinite(a))), "numel": a.size}


def test_sampled_records_match_the_layers_outputs():
    model = mlp()
    amp, watch = applied("mixed_fp16", model, every=2)
    x, y = data(16)
    probe = keras.Model(model.inputs, [model.get_layer(n).output for n in ("fc1", "mid", "head")])
    seen = [keras.ops.convert_to_numpy(t) for t in probe(x, training=True)]  # the weights the step starts from
    model.train_on_batch(x, y)
    record = watch.records[0]
    assert record["step"] == 0 and record["sampled"]
    rows = {(s["path"], s["tensor"]): s for s in record["layers"]}
    for name, out in zip(("fc1", "mid", "head"), seen, strict=True):
        row, want = rows[name, "output"], native_classes(out)
        assert out.dtype == np.float16 and row["dtype"] == "float16"
        assert row["numel"] == want["numel"] and row["amax"] == want["amax"]
        assert all(row[k] == want[k] for k in ("zero", "subnormal", "overflow", "nonfinite"))
    assert [(s["path"], s["tensor"]) for s in record["layers"]] == [
        ("fc1", "output"), ("mid", "output"), ("head", "output"),
        ("head", "grad_output"), ("mid", "grad_output"), ("fc1", "grad_output")]
    assert all(s["amax"] > 0 for s in record["layers"] if s["direction"] == "backward")
    model.train_on_batch(x, y)  # step 1: not sampled, nothing measured
    model.train_on_batch(x, y)  # step 2: sampled
    assert [r["step"] for r in watch.records if r["sampled"]] == [0, 2]
    numerics = amp.report(x).numerics
    assert numerics["sampled_steps"] == 2
    assert {(r["path"], r["tensor"]) for r in numerics["layers"]} == set(rows)
    amp.remove()


def test_a_planted_forward_overflow_is_named_under_fit():
    model = mlp()
    mid = model.get_layer("mid")
    mid.kernel.assign(np.full(mid.kernel.shape, 1e4, np.float32))  # its float16 output overflows
    amp, watch = applied("mixed_fp16", model, every=100)
    x, y = data(16)
    model.fit(np.abs(x) + 1, y, batch_size=8, epochs=1, verbose=0)
    first = watch.skipped[0]
    assert first["step"] == 0 and first["sampled"]
    assert first["first_nonfinite"]["path"] == "mid"
    assert first["first_nonfinite"]["direction"] == "forward"
    assert first["first_nonfinite"]["tensor"] == "output"
    assert "forward: the output of mid" in [s["first_nonfinite"] for s in amp.report(x).numerics["skipped"]]
    amp.remove()


def test_a_planted_backward_overflow_is_named_under_fit():
    model = mlp(middle=Amplify(name="amplify"))
    amp, watch = applied("mixed_fp16", model, every=100, localize=True)
    x, y = small()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert [r["step"] for r in watch.skipped] == [0, 1]  # every step: the gradient is inf at any scale
    for record in watch.skipped:  # localize: unsampled steps are located too
        assert record["first_nonfinite"] == {"path": "amplify", "direction": "backward", "tensor": "grad_input",
                                             "exact": True}
    amp.remove()


def test_an_unsampled_skipped_step_says_why_it_is_not_located():
    model = mlp(middle=Amplify(name="amplify"))
    amp, watch = applied("mixed_fp16", model, every=100)
    x, y = small()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first, second = watch.skipped
    assert first["first_nonfinite"]["path"] == "fc1" and first["first_nonfinite"]["direction"] == "backward"
    assert second["first_nonfinite"] is None and "localize=True" in second["notes"][0]
    amp.remove()


def test_the_taps_change_no_value():
    """Measured (steps 0, 2, 4), checked (1, 3, 5: localize) and plain steps: the same weights, bitwise."""
    x, y = data(48)
    weights = []
    for watched in (False, True):
        model = mlp(seed=3)
        amp = unimp.apply("mixed_fp16", model, keras.optimizers.Adam(1e-3))
        model.compile(optimizer=amp.optimizer, loss="mse")
        w = amp.watch(every=2, localize=True) if watched else None
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
        if w is not None:
            assert [r["step"] for r in w.records if r["sampled"]] == [0, 2, 4]
        weights.append([keras.ops.convert_to_numpy(v) for v in model.weights])
        assert amp.loss_scale_state().steps == 6
        amp.remove()
    assert all(np.array_equal(a, b) for a, b in zip(*weights, strict=True))


def test_close_and_remove_restore_the_model(tmp_path):
    model = mlp()
    amp = unimp.apply("mixed_bf16", model, keras.optimizers.SGD(1e-3))
    model.compile(optimizer=amp.optimizer, loss="mse")
    before = {id(layer): dict(vars(layer)) for layer in model._flatten_layers()}
    watch = amp.watch(every=1)
    x, y = data(16)
    model.fit(x, y, batch_size=8, verbose=0)
    watch.close()
    assert len(watch.records) == 2
    logs = model.fit(x, y, batch_size=8, verbose=0).history  # closed: nothing more recorded
    assert len(watch.records) == 2 and set(logs) == {"loss"}
    for layer in model._flatten_layers():
        own = {k for k in vars(layer) if k not in ("train_function", "_jax_state", "_jax_state_synced")}
        assert {k: vars(layer)[k] for k in own if k in ("call", "make_train_function", "train_step")} == \
            {k: before[id(layer)][k] for k in own if k in before[id(layer)] and
             k in ("call", "make_train_function", "train_step")}
    assert "check_finite" not in vars(amp.optimizer)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert all(np.array_equal(keras.ops.convert_to_numpy(a), keras.ops.convert_to_numpy(b))
               for a, b in zip(loaded.weights, model.weights, strict=True))
    watch = amp.watch(every=1)
    with pytest.raises(UnsupportedError, match="watch.close"):
        copy.deepcopy(amp)
    amp.remove()  # closes the running watch
    assert watch.closed and "make_train_function" not in vars(model)
    assert model.get_layer("fc1").dtype_policy.name == "float32"


def test_a_watch_closed_during_fit_lets_it_finish():
    model = mlp()
    amp, watch = applied("mixed_bf16", model, every=1)
    stop = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch == 1 and watch.close())
    x, y = data(32)
    history = model.fit(x, y, batch_size=8, verbose=0, callbacks=[stop]).history
    assert [r["step"] for r in watch.records] == [0, 1] and set(history) == {"loss"}
    assert amp.loss_scale_state().steps == 4
    amp.remove()


def test_refused_setups_name_the_fix():
    model = mlp()
    amp = unimp.apply("mixed_bf16", model, keras.optimizers.SGD(1e-3))
    x, y = data(16)
    model.compile(optimizer=amp.optimizer, loss="mse", steps_per_execution=2)
    watch = amp.watch()
    with pytest.raises(UnsupportedError, match="steps_per_execution=1"):
        model.fit(x, y, batch_size=8, verbose=0)
    watch.close()
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    watch = amp.watch()
    with pytest.raises(UnsupportedError, match="optimizer=amp.optimizer"):
        model.train_on_batch(x, y)
    amp.remove()
    with pytest.raises(UnsupportedError, match="optimizer"):
        unimp.apply("mixed_bf16", mlp()).watch()
