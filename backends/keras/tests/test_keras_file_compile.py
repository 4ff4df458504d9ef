"""A `.keras` file saved after the README's recipe (``compile(optimizer=amp.optimizer)``, ``fit``,
``model.save``) loads with the default ``keras.models.load_model(path)``, with or without unimp, into
the compile state Keras' own policy + optimizer gives (issue 27, item 16).

Oracle: the same model trained under Keras' own ``mixed_float16`` + ``keras.optimizers.LossScaleOptimizer``
(``mixed_bfloat16`` + the plain optimizer where the policy has no loss scale), saved and loaded the
same way: Keras' ``Model.get_compile_config`` / ``LossScaleOptimizer.get_config`` and
``Optimizer.save_own_variables`` (keras/src/trainers/trainer.py, keras/src/optimizers/) decide both files.
"""

import json
import subprocess
import sys

import keras
import numpy as np
import pytest

import unimp

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4)).astype("float32")
Y = RNG.normal(size=(16, 1)).astype("float32")
# loads a file in a process where neither unimp nor its backend can be imported
LOAD = r"""
import json, sys
sys.modules["unimp"] = sys.modules["unimp_keras"] = None
import keras
out = {}
for path in sys.argv[1:]:
    opt = keras.models.load_model(path).optimizer
    inner = getattr(opt, "inner_optimizer", None)
    config = {k: v for k, v in opt.get_config().items() if k != "name"}
    if inner is not None:
        config["inner_optimizer"] = {k: v for k, v in inner.get_config().items() if k != "name"}
    out[path] = {"class": f"{type(opt).__module__}.{type(opt).__name__}", "config": config,
                 "variables": [[v.path.split("/")[-1], v.dtype, list(v.shape), v.numpy().tolist()]
                               for v in opt.variables]}
print(json.dumps(out))
"""
CASES = {  # preset -> Keras' own dtype policy for the same run
    "mixed_fp16": "mixed_float16", "keras_mixed_float16": "mixed_float16",
    "mixed_bf16": "mixed_bfloat16", "pure_bf16": "mixed_bfloat16",
}


def model(dtype=None):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc1", dtype=dtype),
                             keras.layers.Dense(1, name="fc2", dtype=dtype)], name="net")


def fit_and_save(net, optimizer, path):
    net.compile(optimizer=optimizer, loss="mse")
    net.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    net.save(path)
    return path


def native_file(preset, tmp_path):
    spec = unimp.load(preset).loss_scale
    adam = keras.optimizers.Adam(1e-3)
    # initial = "auto": the scale Keras' own LossScaleOptimizer starts at, so its user passes none
    start = {} if spec.initial_auto else {"initial_scale": spec.initial}
    opt = (keras.optimizers.LossScaleOptimizer(adam, dynamic_growth_steps=spec.growth_interval, **start)
           if spec.mode == "dynamic" else adam)
    return fit_and_save(model(CASES[preset]), opt, str(tmp_path / f"native_{preset}.keras"))


def loaded_without_unimp(paths):
    out = subprocess.run([sys.executable, "-c", LOAD, *paths], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def layout(entry):
    return [(name, dtype, shape) for name, dtype, shape, _ in entry["variables"]]


def test_keras_files_load_with_the_default_call_as_keras_own_policy_gives(tmp_path):
    ours, natives, amps = {}, {}, {}
    for preset in CASES:
        net = model()
        amps[preset] = amp = unimp.apply(preset, net, keras.optimizers.Adam(1e-3))
        ours[preset] = fit_and_save(net, amp.optimizer, str(tmp_path / f"unimp_{preset}.keras"))
        natives[preset] = native_file(preset, tmp_path)
    loaded = loaded_without_unimp([*ours.values(), *natives.values()])
    for preset, path in ours.items():
        got, want = loaded[path], loaded[natives[preset]]
        assert got["class"] == want["class"], preset  # Keras' LossScaleOptimizer, or Adam for bf16
        assert got["config"] == want["config"], preset
        assert layout(got) == layout(want), preset
        state = amps[preset].loss_scale_state()
        values = {name: value for name, _, _, value in got["variables"]}
        if "dynamic_scale" in values:  # the trained scale and growth tracker, in Keras' variables
            assert (values["dynamic_scale"], values["step_counter"]) == (state.scale, state.growth_tracker)
        inner = [v.numpy().tolist() for v in amps[preset].inner_optimizer.variables]
        assert [value for _, _, _, value in got["variables"]][-len(inner):] == inner, preset
        with_unimp = keras.models.load_model(path).optimizer  # unimp importable: the same Keras class
        assert f"{type(with_unimp).__module__}.{type(with_unimp).__name__}" == got["class"]
        amps[preset].remove()


def test_an_applied_model_reads_back_unimps_exact_state(tmp_path):
    """``save_weights`` / ``load_weights`` while applied keep hysteresis and the step counters."""
    net = model()
    amp = unimp.apply("mixed_fp16", net, keras.optimizers.Adam(1e-3))
    net.compile(optimizer=amp.optimizer, loss="mse")
    net.fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    want = amp.loss_scale_state()
    net.save_weights(str(tmp_path / "w.weights.h5"))
    amp.set_loss_scale_state(unimp.spi.LossScaleState(2.0, 0, 1, 0, 0))
    net.load_weights(str(tmp_path / "w.weights.h5"))
    assert amp.loss_scale_state() == want and want.steps == 4
    amp.remove()


@pytest.mark.parametrize("preset", ["mixed_fp16", "mixed_bf16"])
def test_remove_takes_the_compile_config_patch_away(preset):
    net = model()
    amp = unimp.apply(preset, net, keras.optimizers.Adam(1e-3))
    assert "get_compile_config" in vars(net)
    amp.remove()
    assert "get_compile_config" not in vars(net)
