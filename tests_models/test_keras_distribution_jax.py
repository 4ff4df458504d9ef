"""Keras 3 distribution on JAX: ``keras.distribution.DataParallel`` over 2 (virtual CPU) devices under unimp.

A small Keras model is trained with ``model.fit`` under ``unimp.apply`` (mixed_bf16 and mixed_fp16), once with
DataParallel over 2 devices and once on 1 device. Checked: every layer the policy lowers computes as Keras' own
mixed policy (set by hand on the same model) computes it and every report row is the output dtype observed
by wrapping the layer's call; every variable (the model's and the optimizer's, loss-scale state included) lies
as DataParallel lays it out (``distribution.get_variable_layout``: replicated on both devices); each step's
loss equals the 1-device run's within the dtype-derived bound and the loss-scale state is the same.

The 2 devices must exist before JAX starts (``--xla_force_host_platform_device_count=2``), so the body runs in
a subprocess with that flag: ``KERAS_BACKEND=jax python tests_models/test_keras_distribution_jax.py PRESET``.
Skipped unless ``KERAS_BACKEND=jax``.
"""

import json
import os
import subprocess
import sys

import pytest

PRESETS = {"mixed_bf16": "mixed_bfloat16", "mixed_fp16": "mixed_float16"}  # unimp preset -> Keras' own policy
STEPS = 5

pytestmark = pytest.mark.skipif(os.environ.get("KERAS_BACKEND") != "jax",
                                reason="Keras distribution on JAX: runs under KERAS_BACKEND=jax")


def build(keras, policy="float32"):
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu", name="fc1"),
                                  keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(4, name="fc2")])
    finally:
        keras.config.set_dtype_policy("float32")
    return model


def observed(keras, model, x):
    """Each layer's output dtype in one forward, seen by wrapping its call here (not by unimp)."""
    seen = {}
    for layer in model.layers:
        inner = layer.call

        def rec(*a, _l=layer, _c=inner, **k):
            out = _c(*a, **k)
            seen[_l.name] = keras.backend.standardize_dtype(out.dtype)
            return out

        object.__setattr__(layer, "call", rec)
    try:
        model(x)
    finally:
        for layer in model.layers:
            del layer.__dict__["call"]
    return seen


def run(preset: str, devices: int) -> dict:
    """One ``fit`` under ``unimp.apply(preset)``: on ``devices`` devices through DataParallel (2) or plainly (1)."""
    import jax
    import keras
    import numpy as np
    from keras_env import walk

    import unimp

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 16)).astype("float32"), rng.integers(0, 4, (16,))
    dist = keras.distribution.DataParallel(devices=jax.devices()[:devices]) if devices > 1 else None
    keras.distribution.set_distribution(dist)
    try:
        model = build(keras)
        amp = unimp.apply(preset, model, keras.optimizers.Adam(1e-2))
        model.compile(optimizer=amp.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses = model.fit(x, y, batch_size=8, epochs=STEPS, verbose=0, shuffle=False).history["loss"]
        lowered = [u.layer.name for u in amp._binding.units if u.kind in unimp.load(preset).ops.lower]
        seen = observed(keras, model, x)
        native = build(keras, PRESETS[preset])
        theirs = observed(keras, native, x)
        variables = [*model.variables, *amp.optimizer.variables]
        layout = []
        for v in variables:
            sharding = v.value.sharding
            want = dist.get_variable_layout(v) if dist is not None else None
            layout.append({"path": v.path, "devices": len(sharding.device_set),
                           "replicated": sharding.is_fully_replicated,
                           "want_axes": list(want.axes) if want is not None else None})
        return {"losses": [float(v) for v in losses], "units": len(amp._binding.units), "lowered": lowered,
                "ours": {n: [model.get_layer(n).compute_dtype, seen[n]] for n in lowered},
                "theirs": {n: [native.get_layer(n).compute_dtype, theirs[n]] for n in lowered},
                "rows": [[r.path, r.output_dtype, seen.get(r.path)] for r in amp.report(x).rows],
                "kinds": {u.path: u.kind for u in walk(model)},
                "state": amp.state_dict(), "layout": layout, "device_count": len(jax.devices())}
    finally:
        keras.distribution.set_distribution(None)


def in_subprocess(preset: str) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    done = subprocess.run([sys.executable, __file__, preset], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", list(PRESETS))
def test_data_parallel_fit_matches_one_device(preset):
    from tolerance import reference_tolerance

    import unimp

    got = in_subprocess(preset)
    two, one = got["two"], got["one"]
    assert two["device_count"] == 2, "XLA did not make 2 host devices"
    low = unimp.load(preset).compute_dtype
    # per-layer dtypes: what the policy lowers computes as Keras' own policy does; every row is observed
    assert two["lowered"] == ["fc1", "fc2"] and two["ours"] == two["theirs"], (two["ours"], two["theirs"])
    assert all(compute == out == low for compute, out in two["ours"].values()), two["ours"]
    assert two["rows"] and all(out == seen for _, out, seen in two["rows"] if seen is not None), two["rows"]
    assert {p: out for p, out, _ in two["rows"]}["norm"] == "float32"  # norms stay float32 under the preset
    # layout: DataParallel replicates every variable over both devices (get_variable_layout: no sharded axis)
    assert two["layout"] and all(v["devices"] == 2 and v["replicated"] and not any(v["want_axes"])
                                 for v in two["layout"]), two["layout"]
    # the same training as on one device: each step's loss within the bound, the same loss-scale state
    tol = reference_tolerance(low, two["units"])
    rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"]))
    assert rel <= tol, (two["losses"], one["losses"], tol)
    assert two["state"] == one["state"], (two["state"], one["state"])
    assert two["losses"][-1] < two["losses"][0], two["losses"]  # it trains


if __name__ == "__main__":  # the body, in the subprocess with 2 host devices: the result as the last line
    print(json.dumps({"two": run(sys.argv[1], 2), "one": run(sys.argv[1], 1)}))
