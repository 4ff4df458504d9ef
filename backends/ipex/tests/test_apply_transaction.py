"""A failed ``unimp.apply`` through unimp-ipex leaves the model and optimizer exactly as they were
(issue 27 item 4): the backend's snapshot (unimp-torch's) against a complete apply with each engine,
and a Ctrl-C arriving half-way (after ``ipex.optimize`` ran, when unimp-torch binds the policy)."""

import pytest
import torch

import unimp
from unimp_ipex.backend import IpexBackend


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def state_of(model, opt):
    tensors = [(name, id(t), t.dtype, t.detach().reshape(-1).contiguous().view(torch.uint8).tolist())
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    modules = [(path, sorted(m.__dict__), {k: len(v) for k, v in m.__dict__.items() if isinstance(v, dict)})
               for path, m in model.named_modules()]
    opt_state = {id(p): {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for p, s in opt.state.items()}
    return tensors, modules, [[id(p) for p in g["params"]] for g in opt.param_groups], opt_state, sorted(opt.__dict__)


@pytest.mark.parametrize("engine", ["ipex", "torch"])
@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16"])
def test_snapshot_covers_everything_apply_changes(policy, engine):
    model, opt = model_and_optimizer()
    before = state_of(model, opt)
    snap = IpexBackend().snapshot(model, opt)
    amp = unimp.apply(policy, model, opt, backend="ipex", engine=engine)
    snap.restore()
    assert state_of(model, opt) == before
    amp.remove()  # releases what apply holds outside the model; changes nothing here
    assert state_of(model, opt) == before


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("engine", ["ipex", "torch"])
def test_apply_failing_half_way_changes_nothing(engine, error, monkeypatch):
    from unimp_ipex import amp as ipex_amp

    model, opt = model_and_optimizer()
    before = state_of(model, opt)
    real = ipex_amp.bind

    def bind_then_fail(plan, target, *args, **kwargs):  # unimp-torch's bind ran completely, then a Ctrl-C
        real(plan, target, *args, **kwargs)
        raise error("half-way")

    monkeypatch.setattr(ipex_amp, "bind", bind_then_fail)
    with pytest.raises(error):
        unimp.apply("pure_bf16", model, opt, backend="ipex", engine=engine)
    assert state_of(model, opt) == before
    assert not unimp.spi.Amp.is_bound(model)
    monkeypatch.undo()
    amp = unimp.apply("pure_bf16", model, opt, backend="ipex", engine=engine)
    amp.remove()
