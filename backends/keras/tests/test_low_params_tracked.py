"""Low-precision parameter copies are the variables Keras tracks: on Keras' torch backend a model's
``parameters()`` are its variables' tensors, keyed by variable path, and Keras' torch ``train_step`` clears
gradients through ``Model.zero_grad()``. A swapped-in bf16/fp16 copy outside that registry kept its
gradients from step to step (they added up; under ``fp16_master`` one overflow then skipped every later step).

Oracle: Keras' own registry (``model.parameters()``, ``zero_grad``) and the variable paths Keras gave the
originals; on the other Keras backends the paths alone.
"""

import keras
import numpy as np
import pytest

import unimp

X = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
Y = np.arange(8) % 3


def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, name="a"), keras.layers.Dense(3, name="b")])
    m(X)
    return m


@pytest.mark.parametrize("preset", ["pure_bf16", "fp16_master"])
def test_low_copies_keep_their_variable_paths(preset):
    m = model()
    paths = [v.path for v in m.trainable_variables]
    amp = unimp.apply(preset, m, keras.optimizers.SGD(0.1))
    assert {v.dtype for v in m.trainable_variables} == {unimp.load(preset).param_dtype}
    assert [v.path for v in m.trainable_variables] == paths
    amp.remove()
    assert [v.path for v in m.trainable_variables] == paths


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch.nn.Module parameters: Keras' torch backend")
@pytest.mark.parametrize("preset", ["pure_bf16", "fp16_master"])
def test_torch_parameters_are_the_low_copies_and_zero_grad_clears_them(preset):
    m = model()
    amp = unimp.apply(preset, m, keras.optimizers.SGD(0.1))
    m.compile(optimizer=amp.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              run_eagerly=True)
    m.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    m._track_variables()  # what Keras' torch layer does after a (re)build: the registry from the variables
    held = {id(p) for p in m.parameters()}
    assert all(id(v.value) in held for v in m.trainable_variables)
    m.zero_grad()
    assert all(v.value.grad is None or not v.value.grad.any() for v in m.trainable_variables)
    amp.remove()
    held = {id(p) for p in m.parameters()}
    assert all(id(v.value) in held and v.dtype == "float32" for v in m.trainable_variables)
