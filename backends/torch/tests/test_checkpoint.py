"""Checkpoints keep the fp32 master weights: a resume through the documented path is bit-exact.

Documented path: save ``model.state_dict()``, ``amp.optimizer.state_dict()`` and ``amp.state_dict()``;
resume with a new model -> ``unimp.apply`` -> load the three -> train. The expected values are
the uninterrupted run's own (same code, no checkpoint in between).
"""

import io

import pytest
import torch
from torch import nn

import unimp
from unimp.policy.loading import preset_names

MASTER_PRESETS = [p for p in preset_names() if unimp.load(p).uses_master_weights]
OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


class Tied(nn.Module):
    """Embedding + MLP + a head tied to the embedding, and a frozen layer (no master)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(24, 16)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 16))
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(16, 24, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.body(self.emb(idx))))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Tied()


def _apply(preset: str, model: nn.Module, opt_name: str) -> unimp.Amp:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return unimp.apply(unimp.load(preset).replace(loss_scale={"growth_interval": 2}), model,
                       OPTIMIZERS[opt_name](trainable))


def _train(amp: unimp.Amp, steps: range) -> None:
    for i in steps:
        idx = torch.randint(0, 24, (4, 6), generator=torch.Generator().manual_seed(i))
        loss = nn.functional.cross_entropy(amp.model(idx).float().flatten(0, 1), idx.flatten())
        poison = i == 4 and amp.policy.loss_scale.skip_nonfinite  # one skipped step after the resume
        amp.backward(loss * float("inf") if poison else loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()


def _snapshot(amp: unimp.Amp) -> dict:
    return {"params": [t.detach().clone() for t in amp.model.parameters()],
            "masters": [m.detach().clone() for _, _, m in amp.master_weights],
            "optimizer": amp.optimizer.state_dict()["state"], "amp": amp.state_dict()}


def _assert_equal(a: dict, b: dict) -> None:
    assert a["amp"] == b["amp"]
    for key in ("params", "masters"):
        assert len(a[key]) == len(b[key]) > 0
        for x, y in zip(a[key], b[key], strict=True):
            assert x.dtype == y.dtype and torch.equal(x, y), key
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for i, st in a["optimizer"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"][i][k])), (i, k)


@pytest.mark.parametrize(("preset", "opt_name"), [(p, list(OPTIMIZERS)[i % len(OPTIMIZERS)])
                                                   for i, p in enumerate(MASTER_PRESETS)])
def test_resume_is_bit_exact(preset, opt_name):
    n, m = 3, 4
    full = _apply(preset, _model(0), opt_name)
    _train(full, range(n + m))
    expected = _snapshot(full)
    full.remove()

    first = _apply(preset, _model(0), opt_name)
    _train(first, range(n))
    buf = io.BytesIO()
    torch.save({"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict(),
                "amp": first.state_dict()}, buf)
    first.remove()

    buf.seek(0)
    ck = torch.load(buf)
    resumed = _apply(preset, _model(1), opt_name)  # another init: everything must come from the checkpoint
    resumed.model.load_state_dict(ck["model"])
    resumed.optimizer.load_state_dict(ck["optimizer"])
    resumed.load_state_dict(ck["amp"])
    _train(resumed, range(n, n + m))
    _assert_equal(_snapshot(resumed), expected)
    resumed.remove()


def test_resume_loading_the_model_before_apply():
    """The other natural order (load the plain model, then apply) resumes bit-exactly too."""
    full = _apply("pure_bf16", _model(0), "adamw")
    _train(full, range(6))
    expected = _snapshot(full)
    full.remove()
    first = _apply("pure_bf16", _model(0), "adamw")
    _train(first, range(3))
    ck = {"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict(), "amp": first.state_dict()}
    ck = torch.load(_saved(ck))
    first.remove()
    model = _model(1)
    model.load_state_dict(ck["model"])
    resumed = _apply("pure_bf16", model, "adamw")
    resumed.optimizer.load_state_dict(ck["optimizer"])
    resumed.load_state_dict(ck["amp"])
    _train(resumed, range(3, 6))
    _assert_equal(_snapshot(resumed), expected)
    resumed.remove()


def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_model_state_dict_is_the_fp32_masters():
    """While applied, the model's state dict holds the masters (fp32), not their bf16 roundings."""
    model = _model(0)
    amp = _apply("pure_bf16", model, "adamw")
    _train(amp, range(3))
    sd = model.state_dict()
    masters = {name: m for name, _, m in amp.master_weights}
    assert masters
    for name, m in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], m)
    assert torch.equal(sd["head.weight"], masters["emb.weight"])  # the tied name too
    assert sd["frozen.weight"].dtype == torch.float32  # frozen: the fp32 original
    assert model.frozen.weight.dtype == torch.bfloat16
    # a plain fp32 model loaded from it is exactly what remove() gives back
    plain = _model(1)
    plain.load_state_dict(sd)
    amp.remove()
    for (n, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b), n


def test_load_into_applied_model_then_remove_keeps_the_loaded_values():
    """Loaded values reach the masters, the frozen originals and in-place cast params: remove()
    hands back the loaded model, not the one from before the load."""
    source = _model(5)
    want = {k: v.clone() for k, v in source.state_dict().items()}
    for preset in ("pure_bf16", unimp.load("pure_bf16").replace(master_weights={"enabled": False})):
        model = _model(0)
        amp = unimp.apply(preset, model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad]))
        model.load_state_dict(want)
        low = {name: model.get_parameter(name) for name in want}
        for name, value in want.items():  # the params the model computes with: the loaded values, cast
            assert torch.equal(low[name], value.to(low[name].dtype)), name
        low_dtype = {name: p.dtype for name, p in low.items()}
        amp.remove()
        for name, value in model.state_dict().items():
            # masters and frozen originals: exactly the loaded fp32 values; in-place cast: via the low dtype
            expect = want[name] if isinstance(preset, str) else want[name].to(low_dtype[name]).float()
            assert value.dtype == torch.float32 and torch.equal(value, expect), name


def test_assign_load_is_refused_while_applied():
    model = _model(0)
    amp = _apply("pure_bf16", model, "adamw")
    with pytest.raises(unimp.errors.UnsupportedError, match="assign=True"):
        model.load_state_dict(_model(1).state_dict(), assign=True)
    amp.remove()


def test_shape_mismatch_keeps_masters_and_params_consistent():
    """torch refuses a wrong-shaped weight; its master is left as it was, matching the param."""
    model = _model(0)
    amp = _apply("pure_bf16", model, "adamw")
    before = {name: m.detach().clone() for name, _, m in amp.master_weights}
    bad = _model(1).state_dict()
    bad["body.0.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.load_state_dict(bad)
    for name, low, master in amp.master_weights:
        assert torch.equal(low, master.to(low.dtype)), name
    assert torch.equal(dict((n, m) for n, _, m in amp.master_weights)["body.0.weight"], before["body.0.weight"])
    amp.remove()


def test_masters_in_model_for_saving():
    """``with amp.masters_in_model():`` the model holds the fp32 masters (e.g. to save or export)."""
    model = _model(0)
    amp = _apply("pure_bf16", model, "adamw")
    _train(amp, range(2))
    lows = {n: p for n, p in model.named_parameters()}
    with amp.masters_in_model():
        inside = {n: p for n, p in model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in inside.values())
        for name, _, master in amp.master_weights:
            assert inside[name] is master
    after = dict(model.named_parameters())
    assert all(after[n] is lows[n] for n in lows)
    _train(amp, range(2, 4))  # training goes on with the same low params and masters
    for _, low, master in amp.master_weights:
        assert torch.equal(low, master.to(low.dtype))
    amp.remove()


def test_copy_of_the_model_saves_its_own_weights_and_a_copied_amp_its_own_masters():
    """``copy.deepcopy(model)`` (an EMA/teacher copy) saves the copy's own parameters, never the
    original's masters; ``copy.deepcopy(amp)`` gives a copy whose model saves the copy's masters."""
    import copy

    model = _model(0)
    amp = _apply("pure_bf16", model, "adamw")
    _train(amp, range(2))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    for name, value in twin.state_dict().items():  # the copy's own (halved, low-precision) parameters
        own = twin.get_parameter(name)
        assert value.dtype == own.dtype and torch.equal(value, own), name
    if not hasattr(unimp.Amp, "__deepcopy__"):
        amp.remove()
        pytest.skip("copy.deepcopy(amp) is the core's (Amp.__deepcopy__)")
    other = copy.deepcopy(amp)
    _train(other, range(2, 4))
    masters = {name: m for name, _, m in other.master_weights}
    sd = other.model.state_dict()
    for name, m in masters.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], m), name
    assert not torch.equal(sd["body.0.weight"], model.state_dict()["body.0.weight"])  # amp's own, untouched
    other.remove()
    amp.remove()
