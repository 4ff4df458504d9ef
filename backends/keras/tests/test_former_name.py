"""``pip install ./backends/tensorflow`` users keep working: ``unimp_tensorflow`` re-exports unimp_keras' names
and registers no backend of its own (one backend per Keras model)."""

import os
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[3]
SHIM = ROOT / "backends" / "tensorflow"

CHECK = """
import unimp_tensorflow, unimp_keras
from unimp_keras.optimizer import AmpOptimizer, KerasAmpOptimizer
from unimp_keras.amp import KerasAmp
assert unimp_tensorflow.__file__.startswith(%r), unimp_tensorflow.__file__
assert unimp_tensorflow.TensorFlowBackend is unimp_keras.KerasBackend
assert unimp_tensorflow.TensorFlowBackend.name == "keras"
assert unimp_tensorflow.AmpOptimizer is AmpOptimizer and unimp_tensorflow.KerasAmpOptimizer is KerasAmpOptimizer
assert unimp_tensorflow.TensorFlowAmp is KerasAmp and unimp_tensorflow.scope is unimp_keras.scope
import keras, unimp
import unimp.backend.registry as registry
if "keras" not in registry.backends():  # an env with the old unimp-tensorflow installed (see conftest.py)
    registry.register_backend(unimp_keras.KerasBackend)
m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="fc")])
with unimp_tensorflow.scope("mixed_bf16") as s:
    pass
amp = unimp.apply("mixed_bf16", m, keras.optimizers.SGD(0.1))
assert type(amp) is KerasAmp and amp.plan.backend == "keras"
print("ok")
"""


def test_unimp_tensorflow_names_still_work():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SHIM), str(ROOT / "backends" / "keras"), str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CHECK % str(SHIM)], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_unimp_tensorflow_has_no_entry_point_and_depends_on_unimp_keras():
    project = tomllib.loads((SHIM / "pyproject.toml").read_text())["project"]
    assert "entry-points" not in project
    assert any(d.startswith("unimp-keras[tensorflow]") for d in project["dependencies"])
    keras_project = tomllib.loads((ROOT / "backends/keras/pyproject.toml").read_text())["project"]
    assert keras_project["entry-points"]["unimp.backends"] == {"keras": "unimp_keras.backend:KerasBackend"}
