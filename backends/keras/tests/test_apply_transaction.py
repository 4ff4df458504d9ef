"""A failed ``unimp.apply`` leaves a Keras model and its optimizer exactly as they were (issue 27
item 4): every layer its dtype policy, attributes and instance methods, every variable the same
object with the same value bits, the optimizer its attributes. The backend's snapshot is checked
against a complete apply (a failure anywhere restores a subset of it), and a Ctrl-C arriving
half-way (after the dtype policies and low-precision copies were set) through the public apply."""

import keras
import numpy as np
import pytest

import unimp
from unimp_keras.backend import KerasBackend

X = np.random.default_rng(0).normal(size=(8, 12)).astype("float32")


def model_and_optimizer():
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, name="fc1"), keras.layers.ReLU(name="act"),
                              keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(2, name="head")])
    model(X[:2])
    optimizer = keras.optimizers.Adam(1e-3)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(X, np.zeros((8, 2), "float32"), epochs=1, verbose=0)  # optimizer state exists
    return model, optimizer


def state_of(model, optimizer):
    layers = [model, *model._flatten_layers(include_self=False, recursive=True)]
    return {"layers": [(id(layer), type(layer), layer.dtype_policy.name, sorted(layer.__dict__)) for layer in layers],
            "variables": [(id(v), v.path, v.dtype, np.asarray(keras.ops.convert_to_numpy(v.value)).tobytes())
                          for v in model.variables],
            "optimizer": (id(model.optimizer), sorted(optimizer.__dict__),
                          [(id(v), np.asarray(keras.ops.convert_to_numpy(v.value)).tobytes())
                           for v in optimizer.variables])}


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16", "mixed_fp16"])
def test_snapshot_covers_everything_apply_changes(policy):
    model, optimizer = model_and_optimizer()
    before = state_of(model, optimizer)
    snap = KerasBackend().snapshot(model, optimizer)
    amp = unimp.apply(policy, model, optimizer)
    assert state_of(model, optimizer) != before
    snap.restore()
    assert state_of(model, optimizer) == before
    unimp.backend.applied.release(amp._applied_ids)
    model.fit(X, np.zeros((8, 2), "float32"), epochs=1, verbose=0)  # trains as the plain model


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_apply_failing_half_way_changes_nothing(error, monkeypatch):
    from unimp_keras import bind

    model, optimizer = model_and_optimizer()
    before = state_of(model, optimizer)
    reached = []

    def fail(layer, binding):  # the last step of apply_layers: policies set, params swapped
        reached.append(len(binding.swaps))
        raise error("half-way")

    monkeypatch.setattr(bind, "patch_save", fail)
    with pytest.raises(error):
        unimp.apply("pure_bf16", model, optimizer)
    assert reached and reached[0] > 0 and state_of(model, optimizer) == before
    assert not unimp.spi.Amp.is_bound(model)
    monkeypatch.undo()
    amp = unimp.apply("pure_bf16", model, optimizer)
    amp.remove()
