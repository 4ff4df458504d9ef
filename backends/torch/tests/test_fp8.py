"""FP8 training through torchao (CPU emulation here): the Plan's layers, real steps, compile, remove, state dicts."""

import dataclasses

import pytest
import torch
from models import Block
from torch import nn

import unimp

torchao = pytest.importorskip("torchao", reason="FP8 needs torchao: pip install 'unimp-torch[fp8]' (the tox torch "
                                                "env has it)")
from torchao.float8 import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}  # ours -> torchao


def policy(recipe: str, **more) -> dict:
    return {"extends": "fp8_tensorwise", "fp8": {"recipe": recipe, "gradient_format":
                                                 "e5m2" if recipe == "tensorwise" else "e4m3"}, **more}


def mlp() -> nn.Module:
    """Two FP8-able layers (dims multiples of 16) and a head whose 33 outputs keep it in bf16."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 33))


def llama(vocab: int = 72):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


def fp8_paths(model: nn.Module) -> set[str]:
    return {p for p, m in model.named_modules() if isinstance(m, Float8Linear)}


def train(model: nn.Module, preset, steps: int = 3) -> tuple[list[float], object]:
    amp = unimp.apply(preset, model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(steps):
        loss = amp.model(ids, labels=ids).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
    return losses, amp


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_layers_are_torchaos_float8linear_exactly_where_the_plan_says(recipe):
    model = mlp()
    amp = unimp.apply(policy(recipe), model, torch.optim.AdamW(model.parameters()))
    assert fp8_paths(model) == {"0", "2"} and type(model[4]) is nn.Linear
    assert amp.fp8_layers == {"0": recipe, "2": recipe}
    native = Float8LinearConfig.from_recipe_name(RECIPES[recipe])  # torchao's own recipe is the reference
    for layer in (model[0], model[2]):
        assert dataclasses.replace(layer.config, emulate=False) == native and layer.config.emulate
    x = torch.randn(8, 32)
    loss = amp.model(x).square().mean()  # a real step through torchao's FP8 autograd function
    amp.backward(loss)
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
    amp.optimizer.step()
    report = amp.report(x)
    assert [report.row(p).fp8 for p in ("0", "2", "4")] == [recipe, recipe, None]
    assert report.row("4").compute_dtype == "bfloat16"
    assert ("fp8: 4 not FP8: out_features=33 is not a multiple of fp8.dims_multiple (16); stays in bfloat16"
            in report.notes)
    amp.remove()


def test_gradient_format_follows_the_policy():
    model = mlp()
    amp = unimp.apply(policy("rowwise", fp8={"recipe": "rowwise", "gradient_format": "e5m2"}), model)
    assert model[0].config.cast_config_grad_output.target_dtype == torch.float8_e5m2
    assert model[0].config.cast_config_input.target_dtype == torch.float8_e4m3fn
    amp.remove()


def test_overrides_choose_layers():
    model = mlp()
    amp = unimp.apply({"extends": "mixed_bf16", "overrides": [{"modules": ["2"], "fp8": True}]}, model)
    assert fp8_paths(model) == {"2"}
    amp.remove()
    amp = unimp.apply({"extends": "fp8_tensorwise", "overrides": [{"modules": ["0"], "fp8": False}]}, model)
    assert fp8_paths(model) == {"2"}
    assert any("0 not FP8: overrides[0] sets fp8 = false" in n for n in amp.report(torch.randn(2, 32)).notes)
    amp.remove()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_llama_training_in_fp8_stays_close_to_bf16(recipe):
    """Three AdamW steps of a tiny HF Llama: every projection but lm_head (72 outputs) runs FP8; the
    losses stay within 2% of the bf16 run's (same init, same data)."""
    bf16, amp_bf16 = train(llama(), "mixed_bf16")
    model = llama()
    fp8, amp = train(model, policy(recipe))
    linears = {p for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert fp8_paths(model) == linears - {"lm_head"} and len(linears) == 15
    assert fp8[-1] < fp8[0]  # it trains
    for a, b in zip(fp8, bf16, strict=True):
        # FP8 (not derived, kept as is; issue 27): e4m3 keeps 3 mantissa bits (u = 2**-4), so u*sqrt(n)
        # would exceed 6% a layer and pass a broken recipe; 2% is a stated bound of FP8 against bf16
        assert abs(a - b) <= 0.02 * b, (fp8, bf16)
    amp.remove()
    amp_bf16.remove()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_an_overflow_reaching_an_fp8_layer_skips_the_step(recipe):
    """An inf input to an FP8 layer (an fp16 overflow upstream) is not clipped to the FP8 max: the
    output turns non-finite, the loss-scale check skips the step, and nothing changes (the JAX
    backend's current scaling does the same)."""
    model = mlp()
    amp = unimp.apply(policy(recipe, loss_scale={"mode": "dynamic", "initial": 2.0 ** 10}), model,
                      torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(8, 32)
    x[3, 5] = float("inf")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss = amp.model(x).float().square().mean()
    amp.backward(loss)
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    assert not torch.isfinite(loss) and amp.skipped_steps == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    amp.remove()


def test_remove_restores_the_original_linears_with_trained_values():
    model = llama()
    before = {p: m for p, m in model.named_modules()}
    _, amp = train(model, "fp8_tensorwise", steps=1)
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amp.remove()
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[p] is before[p] for p in before)
    assert not fp8_paths(model) and type(model.model.layers[0].mlp.up_proj) is nn.Linear
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_state_dict_round_trip():
    """An FP8 model's state_dict has the plain model's keys; it loads into a fresh FP8 model and into
    a plain one (FP8 layers hold no extra state: dynamic scaling)."""
    model = llama()
    _, amp = train(model, "fp8_tensorwise", steps=2)
    sd = model.state_dict()
    assert sd.keys() == llama().state_dict().keys()
    fresh = llama()
    amp2 = unimp.apply("fp8_tensorwise", fresh, torch.optim.AdamW(fresh.parameters()))
    fresh.load_state_dict(sd)
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(amp2.model(ids).logits, amp.model(ids).logits, rtol=0, atol=0)
    plain = llama()
    plain.load_state_dict(sd)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in sd.items())
    amp.remove()
    amp2.remove()


@pytest.mark.parametrize(("recipe", "name"), [("tensorwise", "llama"), ("rowwise", "block")])
def test_compiles_without_graph_breaks(recipe, name):
    """unimp adds no graph break to torchao's FP8 layers; compiled = eager."""
    torch._dynamo.reset()
    model, x = (llama(), torch.randint(0, 64, (2, 8))) if name == "llama" else (Block(), torch.randn(2, 4, 16))
    amp = unimp.apply(policy(recipe), model, torch.optim.AdamW(model.parameters()))
    assert fp8_paths(model)
    explained = torch._dynamo.explain(amp.model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled, eager = torch.compile(amp.model, backend="aot_eager")(x), amp.model(x)
    c, e = (compiled.logits, eager.logits) if name == "llama" else (compiled, eager)
    # FP8 (kept as is; issue 27): aot_eager runs eager's kernels, so this could be bit for bit as in
    # test_compile.py; left to the FP8 owners
    torch.testing.assert_close(c, e, atol=1e-2, rtol=1e-2)
    amp.remove()


def test_delayed_scaling_is_refused_naming_torchao_or_falls_back():
    with pytest.raises(unimp.UnsupportedError, match=r"fp8\.recipe = 'delayed': backend torch cannot run it "
                                                     r"\(torchao .* has only dynamic scaling"):
        unimp.apply("fp8_delayed", mlp())
    model = mlp()
    amp = unimp.apply({"extends": "te_delayed", "on_unsupported": "fallback"}, model)
    assert not fp8_paths(model) and amp.fp8_layers == {}
    assert not amp.plan.fp8.active and "delayed" in amp.plan.fp8.fallback
    report = amp.report(torch.randn(2, 32))
    assert report.row("0").compute_dtype == "bfloat16" and report.row("0").fp8 is None
    assert any(n.startswith("fp8: fallback to the compute dtype: fp8.recipe = 'delayed'") for n in report.notes)
    assert "fp8: fallback to the compute dtype" in str(amp.plan)
    amp.remove()


def test_explain_names_torchaos_recipe_and_the_cpu_emulation():
    from unimp_torch.backend import TorchBackend

    plan = TorchBackend().compile(unimp.load("fp8_rowwise"))
    text = str(plan)
    assert (f"fp8: runs as torchao {torchao.__version__} convert_to_float8_training, "
            f"Float8LinearConfig.from_recipe_name('rowwise'), emulate=True") in text
    assert plan.to_dict()["fp8"]["recipe"] == "rowwise" and plan.fp8.capable == ("linear",)
    with pytest.raises(unimp.UnsupportedError, match=r"fp8\.ops: 'attention': backend torch runs FP8 only for "
                                                     r"linear"):
        TorchBackend().compile(unimp.load({"extends": "fp8_rowwise", "fp8": {"ops": ["linear", "attention"]}}))
