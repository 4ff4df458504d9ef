"""Layer kinds of third-party modules (HF RMSNorm, GPT-2 Conv1D) and means as reductions.

HF models need ``transformers`` (skipped without it): tiny configs, random init, CPU.
"""

import pytest
import torch
from torch import nn

import unimp

LOW = torch.bfloat16


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def test_llama_rmsnorm_keeps_float32_params_under_pure_bf16():
    model = _llama()
    amp = unimp.apply("pure_bf16", model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 3
    assert all(m.weight.dtype == torch.float32 for m in norms)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == LOW  # the rest follows the policy
    ids = torch.randint(0, 64, (2, 8))
    report = amp.report(ids)
    for path in ("model.norm", "model.layers.0.input_layernorm"):
        row = report.row(path)
        assert (row.kind, row.param_dtype) == ("rms_norm", "float32")
    loss = amp.model(ids, labels=ids).loss
    amp.backward(loss)
    amp.optimizer.step()
    assert all(m.weight.dtype == torch.float32 for m in norms)
    amp.remove()


def test_gpt2_conv1d_is_a_linear():
    model = _gpt2()
    # an override by kind reaches Conv1D: its matmul computes in float32 (observed by a hook)
    policy = {"extends": "mixed_bf16", "overrides": [{"types": ["linear"], "compute_dtype": "float32"}]}
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters()))
    seen = {}
    attn = model.transformer.h[0].attn.c_attn
    hook = attn.register_forward_hook(lambda m, a, out: seen.update(out=out.dtype))
    ids = torch.randint(0, 64, (2, 8))
    amp.model(ids)
    hook.remove()
    assert seen["out"] == torch.float32
    row = amp.report(ids).row("transformer.h.0.attn.c_attn")
    assert (row.kind, row.compute_dtype) == ("linear", "float32")
    amp.remove()
    model = _gpt2()
    amp = unimp.apply("pure_bf16", model, torch.optim.AdamW(model.parameters()))
    row = amp.report(ids).row("transformer.h.0.mlp.c_fc")
    assert (row.kind, row.param_dtype, row.compute_dtype) == ("linear", "bfloat16", "bfloat16")
    amp.remove()


class TinyRMSNorm(nn.Module):  # a user's own norm: recognised by name and shape
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class BlockLayerNorm(nn.Module):  # a composite named like a norm: gets no kind
    def __init__(self, n: int) -> None:
        super().__init__()
        self.inner = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_structural_kinds_only_for_leaf_modules():
    model = nn.Sequential(nn.Linear(8, 8), TinyRMSNorm(8), BlockLayerNorm(8))
    amp = unimp.apply("pure_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert model[1].weight.dtype == torch.float32  # a norm's params stay float32 under pure_bf16
    assert model[2].inner.weight.dtype == LOW
    report = amp.report(torch.randn(2, 8))
    assert report.row("1").kind == "rms_norm"
    assert "2" not in [r.path for r in report.rows] or report.row("2").kind is None
    amp.remove()


class MeanHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x).mean((2, 3))  # a global average pool written as a mean
        self.seen = out.dtype  # the mean's own dtype (the model's output is cast to float32 anyway)
        return out


def test_mean_runs_in_float32_under_mixed_bf16():
    # the policy's reduction category covers means (as Keras and Flax run them); torch's CPU
    # autocast lists no reduction, so unimp moves them all, mean included
    device = "cpu"
    assert unimp.load("mixed_bf16").ops.category("reduction") == "float32"
    model = MeanHead().to(device)
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
    x = torch.randn(2, 8, 8, 8, device=device)
    eager = amp.model(x)
    assert model.seen == torch.float32
    with torch.autocast(device, dtype=LOW):
        conv = model.conv(x)
    assert conv.dtype == LOW  # the mean's input is low: float32 comes from the reduction rule
    torch.testing.assert_close(eager, conv.float().mean((2, 3)), rtol=1e-6, atol=1e-6)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(amp.model)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    model.seen = None
    compiled = torch.compile(amp.model, backend="aot_eager")(x)
    assert model.seen == torch.float32
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)  # a bf16 mean is ~1e-3 off
    amp.remove()


def test_mean_on_cuda_follows_reduction_except_under_torchs_own_lists():
    """CUDA autocast keeps reductions (sum, prod, ...) in float32 but lists no mean. A policy whose
    reduction is float32 runs mean in float32 on CUDA as on CPU; torch_autocast_cuda (torch's own
    lists) stays plain autocast and the plan says so (read from the dispatcher, no GPU needed)."""
    from unimp.spi import Plan
    from unimp_torch.plan import compile_plan

    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::sum.dim_IntList", "AutocastCUDA")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::mean.dim", "AutocastCUDA")
    assert unimp.load("mixed_bf16").ops.category("reduction") == "float32"
    request = Plan.request(unimp.load("mixed_bf16"), "torch")
    assert compile_plan(request, device="cuda").details.op_moves["mean"] == "float32"
    assert compile_plan(request, device="cpu").details.op_moves["mean"] == "float32"
    own = compile_plan(Plan.request(unimp.load("torch_autocast_cuda"), "torch"), device="cuda")
    assert "mean" not in own.details.op_moves
    assert any(n.startswith("reduction: torch keeps its own choice for mean") for n in own.notes)


def test_hf_attention_is_visible_in_reports_without_changing_decisions():
    model = _llama()
    amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
    assert amp.wrapped == []  # the annotation wraps nothing
    q = torch.randn(1, 2, 4, 8)
    with torch.autocast("cpu", dtype=LOW):  # what torch's autocast makes of the block's SDPA
        want = str(nn.functional.scaled_dot_product_attention(q, q, q).dtype).removeprefix("torch.")
    row = amp.report(torch.randint(0, 64, (2, 8))).row("model.layers.0.self_attn")
    assert row.kind == "attention" and row.param_dtype is None
    assert row.compute_dtype == want == "bfloat16"  # its attention op's, not its rotary embedding's (float32)
    amp.remove()
