"""A failed ``unimp.apply`` leaves the model and optimizer exactly as they were (issue 27 item 4).

"Exactly": every parameter and buffer slot holds the same object with the same storage, dtype and
bytes, the optimizer holds the same parameters in the same groups with the same state, no forward,
hook or attribute is left behind; a second apply after fixing the cause works. Inputs unimp cannot
bind (TorchScript modules, uninitialised lazy parameters) are refused before anything changes,
with the module path and the fix.
"""

import pytest
import torch
from torch import nn

import unimp
from unimp.errors import UnsupportedError


def state_of(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    """Everything apply may touch, by identity and by bytes."""
    tensors = {}
    for path, m in model.named_modules():
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is None or torch.nn.parameter.is_lazy(t):
                tensors[f"{path}.{name}"] = (id(t), type(t).__name__)
                continue
            tensors[f"{path}.{name}"] = (id(t), t.dtype, t.requires_grad, t.stride(), t.untyped_storage().data_ptr(),
                                         bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()))
    modules = {path: (sorted(m.__dict__), {k: len(v) for k, v in m.__dict__.items() if isinstance(v, dict)},
                      "forward" in m.__dict__) for path, m in model.named_modules()}
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups] if opt is not None else None
    opt_state = ({id(p): {k: (v.dtype, v.tolist()) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                  for p, s in opt.state.items()} if opt is not None else None)
    return {"tensors": tensors, "modules": modules, "groups": groups, "opt_state": opt_state,
            "opt_keys": sorted(opt.__dict__) if opt is not None else None}


class RefusesStateDictHooks(nn.Linear):
    """A layer that refuses state-dict hooks, as ``torch.jit.RecursiveScriptModule`` does
    (torch/jit/_script.py: ``register_state_dict_post_hook`` raises "not supported on ScriptModules");
    it raises ``error`` so the same path is exercised with a Ctrl-C."""

    error: BaseException = RuntimeError("register_state_dict_post_hook is not supported here")

    def register_state_dict_post_hook(self, hook):
        raise self.error


def _trained(model: nn.Module) -> torch.optim.Optimizer:
    """An AdamW with state (two real steps), so its state must survive too."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


class RefusesForward(nn.Sequential):
    """A model whose instance ``forward`` cannot be replaced (a ``__setattr__`` that guards it, as
    frozen wrappers do): unimp fails when it installs the policy's forward on the root, after the
    parameters were cast and the layers wrapped."""

    error: BaseException | None = RuntimeError("forward is read-only")

    def __setattr__(self, name, value):
        if name == "forward" and self.error is not None:
            raise self.error
        super().__setattr__(name, value)


# under the mixed presets no parameter is cast, so the failure comes later (the root's forward)
CASES = [("pure_bf16", "hooks"), ("fp16_master", "hooks"), ("pure_bf16", "forward"), ("fp16_master", "forward"),
         ("mixed_fp16", "forward"), ("mixed_bf16", "forward")]


@pytest.mark.parametrize("error", [RuntimeError("refused"), KeyboardInterrupt()], ids=["RuntimeError", "Ctrl-C"])
@pytest.mark.parametrize(("preset", "where"), CASES)
def test_apply_failing_half_way_changes_nothing(preset, where, error):
    torch.manual_seed(0)
    late = RefusesStateDictHooks(16, 8)
    late.error = error
    model = RefusesForward(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), late)
    model.error = error if where == "forward" else None
    if where == "forward":
        late.__class__ = nn.Linear
    opt = _trained(model)
    before = state_of(model, opt)
    # an override wraps layer 1 (its forward replaced) before the failure
    policy = {"extends": preset, "overrides": [{"modules": ["1"], "compute_dtype": "float32"}]}
    with pytest.raises(type(error)):
        unimp.apply(policy, model, opt)
    assert state_of(model, opt) == before
    assert not unimp.spi.Amp.is_bound(model)
    assert model(torch.randn(4, 8)).dtype == torch.float32  # the model runs as before
    # the cause removed, the same model and optimizer apply and train
    late.__class__, model.error = nn.Linear, None
    amp = unimp.apply(policy, model, opt)
    amp.backward(amp.model(torch.randn(4, 8)).float().square().mean())
    amp.optimizer.step()
    amp.remove()


@pytest.mark.parametrize("preset", ["pure_bf16", "mixed_fp16"])
def test_ctrl_c_after_the_backend_bound_the_model_is_rolled_back(preset):
    """A Ctrl-C in the last thing ``unimp.apply`` does (marking the model applied, after the backend
    bound it): the model and optimizer are as they were, nothing is marked applied, a second apply works.
    The interrupt is raised by a trace function at that call, as a real Ctrl-C would arrive there."""
    import sys

    from unimp.backend import applied

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8))
    opt = _trained(model)
    before = state_of(model, opt)

    def interrupt(frame, event, arg):
        if event == "call" and frame.f_code is applied.remember.__code__:
            raise KeyboardInterrupt

    sys.settrace(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            unimp.apply(preset, model, opt)
    finally:
        sys.settrace(None)
    assert state_of(model, opt) == before
    assert not unimp.spi.Amp.is_bound(model)
    amp = unimp.apply(preset, model, opt)
    amp.backward(amp.model(torch.randn(4, 8)).float().square().mean())
    amp.optimizer.step()
    amp.remove()


def test_uninitialised_lazy_module_is_refused_before_anything_changes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LazyLinear(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = state_of(model, opt)
    with pytest.raises(UnsupportedError, match=r"'1\.weight' \(LazyLinear\) is an uninitialised lazy parameter; "
                                               r"run one forward with an example batch"):
        unimp.apply("pure_bf16", model, opt)
    assert state_of(model, opt) == before
    model(torch.randn(2, 8))  # the fix the message names
    amp = unimp.apply("pure_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[1].weight.dtype == torch.bfloat16
    amp.remove()


@pytest.mark.parametrize("where", ["model", "submodule"])
def test_torchscript_is_refused_before_anything_changes(where):
    torch.manual_seed(0)
    if where == "model":
        model = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
        path = "the model itself"
    else:
        model = nn.Sequential(nn.Linear(8, 8), torch.jit.script(nn.Linear(8, 4)))
        path = "'1'"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = state_of(model, opt)
    with pytest.raises(UnsupportedError, match=f"model: {path} is a TorchScript module .*before torch.jit.script"):
        unimp.apply("pure_bf16", model, opt)
    assert state_of(model, opt) == before


@pytest.mark.parametrize("preset", ["pure_bf16", "fp16_master", "mixed_fp16", "mixed_bf16"])
def test_snapshot_covers_everything_apply_changes(preset):
    """The backend's snapshot alone (without bind's own undo) puts back all that a complete apply
    changed: what the core restores on any failure, wherever it happens."""
    from unimp_torch.backend import TorchBackend

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.BatchNorm1d(16), nn.Linear(16, 8))
    opt = _trained(model)
    before = state_of(model, opt)
    snap = TorchBackend().snapshot(model, opt)
    amp = unimp.apply({"extends": preset, "overrides": [{"modules": ["1"], "compute_dtype": "float32"}]}, model, opt)
    assert state_of(model, opt) != before
    snap.restore()
    assert state_of(model, opt) == before
    amp.remove()  # releases what apply holds outside the model (unimp's Autocast kernels); changes nothing here
    assert state_of(model, opt) == before
