"""A failed ``unimp.apply`` leaves a Paddle dygraph model and its optimizer exactly as they were
(issue 27 item 4): every parameter and buffer the same object with the same dtype and bits, every
sublayer its attributes (no forward left behind), the optimizer its attributes. The backend's
snapshot is checked against a complete apply (O2 included: parameters cast in place), and a Ctrl-C
arriving half-way (after the forwards were wrapped, when the optimizer is)."""

import numpy as np
import paddle
import pytest

import unimp
from unimp_paddle.backend import PaddleBackend


def fallback(preset):
    """The preset as Paddle runs it here (dygraph has no low-precision CPU kernels: the Plan's fallback)."""
    return {"extends": preset, "on_unsupported": "fallback"}


def model_and_optimizer():
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.LayerNorm(16),
                                 paddle.nn.BatchNorm1D(16), paddle.nn.Linear(16, 4))
    optimizer = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=1e-3)
    model(paddle.randn([4, 8])).square().mean().backward()
    optimizer.step()
    optimizer.clear_grad()
    return model, optimizer


def state_of(model, optimizer):
    layers = [model, *model.sublayers()]
    tensors = [(id(t), str(t.dtype), t.numpy().tobytes()) for layer in layers
               for t in (*layer._parameters.values(), *layer._buffers.values())]
    return {"tensors": tensors, "layers": [(id(layer), sorted(layer.__dict__)) for layer in layers],
            "optimizer": sorted(optimizer.__dict__),
            "groups": [id(p) for p in optimizer._parameter_list]}


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16", "mixed_fp16", "fp16_master"])
def test_snapshot_covers_everything_apply_changes(policy):
    model, optimizer = model_and_optimizer()
    before = state_of(model, optimizer)
    snap = PaddleBackend().snapshot(model, optimizer)
    amp = unimp.apply(fallback(policy), model, optimizer)
    assert state_of(model, optimizer) != before
    snap.restore()
    assert state_of(model, optimizer) == before
    unimp.backend.applied.release(amp._applied_ids)
    assert model(paddle.randn([4, 8])).dtype == paddle.float32


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("policy", ["pure_bf16", "mixed_bf16"])
def test_apply_failing_half_way_changes_nothing(policy, error, monkeypatch):
    from unimp_paddle import amp as paddle_amp

    model, optimizer = model_and_optimizer()
    before = state_of(model, optimizer)
    calls = []

    def fail(*args, **kwargs):  # the last step of apply: forwards wrapped, state saved
        calls.append(model.__dict__.get("forward"))
        raise error("half-way")

    monkeypatch.setattr(paddle_amp, "AmpOptimizer", fail)
    with pytest.raises(error):
        unimp.apply(fallback(policy), model, optimizer)
    assert calls[0] is not None  # the model's forward was wrapped when it failed
    assert state_of(model, optimizer) == before
    assert not unimp.backend.applied.is_applied(model)
    monkeypatch.undo()
    amp = unimp.apply(fallback(policy), model, optimizer)
    out = amp.model(paddle.randn([4, 8]))
    assert np.isfinite(out.astype("float32").numpy()).all()
    amp.remove()
