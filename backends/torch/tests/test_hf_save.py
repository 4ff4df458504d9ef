"""pure_bf16 on a Hugging Face model: ``save_pretrained`` keeps the fp32 master weights.

Needs ``transformers`` (skipped without it). Tiny GPT-2 from a config, random init, CPU.
"""

import pytest
import torch

import unimp

transformers = pytest.importorskip("transformers")


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def _train(amp: unimp.Amp, steps: int) -> None:
    for i in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i))
        amp.backward(amp.model(input_ids=ids, labels=ids).loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()


def test_save_pretrained_inside_masters_in_model_saves_the_fp32_masters(tmp_path):
    """``with amp.masters_in_model(): model.save_pretrained(d)`` writes the fp32 masters and config
    dtype float32; ``from_pretrained(d)`` gives the fp32 model, bit-exact, norms included."""
    model = _gpt2()
    amp = unimp.apply("pure_bf16", model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train(amp, 3)
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16
    with amp.masters_in_model():
        model.save_pretrained(tmp_path)
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16  # the training dtypes again
    amp.remove()  # remove() hands back the fp32 model with the masters' values: the reference
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.dtype == torch.float32
    want = model.state_dict()
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, want[name]), name
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in loaded.state_dict().values())
