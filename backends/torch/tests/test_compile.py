"""torch.compile traces the policy's forward: zero graph breaks, eager's outputs, other models unaffected."""

import copy
import dataclasses

import pytest
import torch
from models import Block, ConvNet
from torch import nn
from torch._dynamo.utils import counters

import unimp
from unimp import hardware
from unimp.backend import NoForwardError
from unimp.dtypes import reference_tolerance

# Under a simulated smaller CPU (UNIMP_CPU_FEATURES, `python -m unimp.hardware --simulate avx2`) torch's inductor
# miscompiles on this kind of host: with ATEN_CPU_CAPABILITY=avx2 on an AVX512 host, a plain float32
# `nn.Sequential(Conv2d, ReLU, Flatten, Linear)` compiled by inductor returns NaN, without unimp (torch 2.13).
# A real AVX2-only CPU does not (the AVX2 EPYC run of this file was green). The simulation cannot stand for
# inductor's code generation, so there AOT autograd (same graph, autocast and casts; eager kernels) compiles.
INDUCTOR = "aot_eager" if hardware.cpu().simulated else "inductor"

CUSTOM = {"extends": "mixed_bf16", "ops": {"lower": ["softmax", "conv"], "float32": ["matmul", "linear"]},
          "overrides": [{"modules": ["head"], "compute_dtype": "float32"}]}


def _check(amp, *args, backend="inductor", **kwargs):
    """Compiled first (right after apply, as a user would), then eager: the same outputs."""
    explained = torch._dynamo.explain(amp.model)(*args, **kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(amp.model, backend=backend)(*args, **kwargs)
    eager = amp.model(*args, **kwargs)
    return eager, compiled


@pytest.mark.parametrize("policy", ["mixed_bf16", "pure_bf16", CUSTOM], ids=["mixed_bf16", "pure_bf16", "custom"])
def test_convnet_and_block_compile_without_graph_breaks(policy):
    torch._dynamo.reset()
    for model, x in ((ConvNet(), torch.randn(2, 3, 8, 8)), (Block(), torch.randn(2, 4, 16))):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the presets' output dtype is torch.autocast's:
            native = copy.deepcopy(model)(x).dtype  # ConvNet's head Linear bf16, Block's residual add float32
        amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters()))
        # inductor once (the real code path); AOT autograd (where autocast and casts are traced) otherwise
        backend = INDUCTOR if policy == "mixed_bf16" else "aot_eager"
        eager, compiled = _check(amp, x, backend=backend)
        # CUSTOM runs linear (the head) in float32
        assert compiled.dtype == eager.dtype == (torch.float32 if policy is CUSTOM else native)
        if backend == "aot_eager":  # the traced graph runs eager's kernels: bit for bit
            assert torch.equal(compiled, eager)
        else:  # inductor fuses ops and skips roundings between them: another rounding of a bf16 forward
            layers = sum(1 for m in model.modules() if next(m.children(), None) is None)
            rel = float((compiled.float() - eager.float()).norm() / eager.float().norm())
            assert rel <= reference_tolerance("bfloat16", layers), rel
        amp.remove()


def test_hf_llama_compiles_without_graph_breaks():
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = copy.deepcopy(model)(ids).logits.dtype  # torch.autocast: lm_head's bf16, not cast
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
    eager, compiled = _check(amp, ids, labels=ids, backend="aot_eager")  # autocast traced by AOT; no C++ build
    assert type(compiled) is type(eager) and compiled.logits.dtype == eager.logits.dtype == native == torch.bfloat16
    assert torch.equal(compiled.logits, eager.logits) and torch.equal(compiled.loss, eager.loss)  # eager's kernels
    amp.remove()


def test_compiled_training_then_other_models_still_compile():
    torch._dynamo.reset()
    model = ConvNet()
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    amp.model.compile(backend=INDUCTOR)  # in place, right after apply (the first forward is compiled, not observed)
    x = torch.randn(2, 3, 8, 8)
    losses = []
    counters.clear()
    for _ in range(3):
        loss = amp.model(x).square().mean()
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # compiled once, whole
    assert amp.report(x).row("conv").compute_dtype == "bfloat16"
    amp.remove()
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 4))
    explained = torch._dynamo.explain(plain)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch.testing.assert_close(torch.compile(plain, backend=INDUCTOR)(x), plain(x))


def test_apply_on_a_compiled_module():
    torch._dynamo.reset()
    model = Block()
    compiled = torch.compile(model)
    amp = unimp.apply("mixed_bf16", compiled, torch.optim.AdamW(model.parameters()))
    assert amp.model is compiled
    out = amp.model(torch.randn(2, 4, 16))
    assert out.dtype == torch.float32 and model.seen["softmax"] == torch.float32  # the policy runs
    with pytest.raises(RuntimeError, match="already has a unimp policy"):
        unimp.apply("mixed_bf16", model)
    amp.remove()
    assert "forward" not in model.__dict__


class Attention(nn.Module):
    """nn.MultiheadAttention (F.multi_head_attention_forward is written in Python) and Tensor
    methods written in Python (unflatten, split, norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, weights = self.mha(x, x, x, need_weights=True)
        self.seen["weights"] = weights.dtype  # a softmax inside F.multi_head_attention_forward
        h = out.unflatten(-1, (4, 4)).flatten(-2).split(8, -1)[0]
        return h.norm(dim=-1)


def test_torch_functions_written_in_python_follow_the_policy_eager_and_compiled():
    torch._dynamo.reset()
    model = Attention()
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch's CPU autocast leaves softmax in bf16
        model(x)
    assert model.seen["weights"] == torch.bfloat16
    amp = unimp.apply("mixed_bf16", model)
    assert amp.policy.decide("mha", "softmax").compute_dtype == "float32"
    explained = torch._dynamo.explain(amp.model)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(amp.model, backend="aot_eager")(x)
    assert model.seen["weights"] == torch.float32  # compiled: the policy's softmax
    model.seen.clear()
    eager = amp.model(x)
    assert model.seen["weights"] == torch.float32  # eager: the same
    torch.testing.assert_close(compiled, eager)
    amp.remove()


def test_every_preset_traces_without_graph_breaks():
    torch._dynamo.reset()
    x = torch.randn(2, 4, 16)
    for preset in unimp.preset_names():
        model = Block()
        try:
            amp = unimp.apply(preset, model, torch.optim.AdamW(model.parameters()))
        except unimp.UnsupportedError as e:  # FP8 this torch cannot run (delayed scaling; no torchao)
            assert unimp.load(preset).fp8.enabled and "asks FP8 that backend torch cannot run" in str(e), preset
            continue
        explained = torch._dynamo.explain(amp.model)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (preset, explained.break_reasons)
        amp.remove()


@pytest.mark.parametrize(("policy", "how"), [
    ("mixed_bf16", "torch.compile(amp.model)"), ("mixed_bf16", "amp.model.compile()"),
    ("mixed_bf16", "apply(torch.compile(model))"), ("pure_bf16", "torch.compile(amp.model)"),
    (CUSTOM, "amp.model.compile()")], ids=lambda v: "custom" if isinstance(v, dict) else v)
def test_report_after_compiled_training_equals_eager(policy, how):
    """amp.report() without inputs after training only through torch.compile (no eager call ever):
    every layer with the dtypes of the report of the same model run eagerly; no graph break, no
    recompilation for it; the model's BatchNorm statistics and RNG untouched by the report."""
    for make, x in ((ConvNet, torch.randn(2, 3, 8, 8)), (Block, torch.randn(2, 4, 16))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager_model = make()
        eager_amp = unimp.apply(policy, eager_model, torch.optim.AdamW(eager_model.parameters()))
        eager_amp.model(x)
        expected = eager_amp.report().rows
        eager_amp.remove()

        torch.manual_seed(0)
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if how == "apply(torch.compile(model))":
            amp = unimp.apply(policy, torch.compile(model, backend="aot_eager"), opt)
            run = amp.model
        else:
            amp = unimp.apply(policy, model, opt)
            if how == "amp.model.compile()":
                amp.model.compile(backend="aot_eager")
                run = amp.model
            else:
                run = torch.compile(amp.model, backend="aot_eager")
        counters.clear()
        for _ in range(3):
            amp.backward(run(x).float().square().mean())
            amp.optimizer.step()
            amp.optimizer.zero_grad()
        assert not counters["graph_break"]  # (Block's own `seen` dict makes dynamo recompile it once)
        assert counters["stats"]["unique_graphs"] == (1 if make is ConvNet else 2)
        buffers = [b.clone() for b in model.buffers()]
        rng = torch.get_rng_state()
        report = amp.report()
        assert report.rows == expected, "\n".join(report.diff(dataclasses.replace(report, rows=expected)))
        assert report.steps == 3
        assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
        assert torch.equal(rng, torch.get_rng_state())
        amp.remove()


def test_report_before_any_call_names_the_fix():
    model = Block()
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
    torch.compile(amp.model, backend="aot_eager")  # compiled, never called
    with pytest.raises(NoForwardError, match=r"no forward has run under this Amp yet; run amp.model\(x\)"):
        amp.report()
    amp.remove()
