"""HF transformers GPT-2 / BERT (tiny configs, random init) under the torch presets (timm and torchvision:
``test_vision_models.py``, in the ``ipex`` env, the one with torch 2.8)."""

import copy

import pytest
import torch
import transformers
from torch_cells import LOW_PARAMS, NATIVE, check_remove, check_report, check_training

import unimp

G = torch.Generator().manual_seed(0)
IDS = torch.randint(0, 64, (4, 12), generator=G)
CLS = torch.randint(0, 3, (4,), generator=G)


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": IDS, "labels": IDS}


def bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg), {"input_ids": IDS, "labels": CLS}


MODELS = {"hf_gpt2_lm": gpt2, "hf_bert_classifier": bert}


@pytest.mark.parametrize("preset", list(NATIVE))
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model(name, preset, cell, tmp_path):
    c = cell("torch", name, preset)
    model, batch = MODELS[name]()
    model.train()
    check_remove(c, model, preset, lambda m: m(**batch).logits)

    native = copy.deepcopy(model)
    amp = unimp.apply(preset, model, torch.optim.AdamW(model.parameters(), 1e-3))
    check_training(c, preset, amp, model, native, lambda m: m(**batch).loss)
    check_report(c, amp, model, lambda m: m(**batch), preset)
    low = LOW_PARAMS.get(preset)

    # save_pretrained while applied (a plain call) -> from_pretrained equals the model after remove():
    # the fp32 masters for presets with low-precision parameters, config dtype float32
    model.save_pretrained(tmp_path)
    amp.remove()
    loaded = type(model).from_pretrained(tmp_path)
    mine = model.state_dict()
    assert loaded.config.dtype == torch.float32, loaded.config.dtype
    assert all(v.dtype == torch.float32 and torch.equal(v, mine[k]) for k, v in loaded.state_dict().items())
    if low:
        assert any(not torch.equal(v, v.to(low).float()) for v in loaded.state_dict().values())
    c.check("save/load", "save_pretrained while applied -> from_pretrained = the model after remove()"
            + (" (the fp32 masters, config dtype float32)" if low else ""))


def test_float16_storage_float32_compute_gpt2():
    """``param_dtype`` float16 with ``compute_dtype`` float32 (``fp16_master`` so overridden): the
    forward computes in float32 with the float16 parameters cast up (loss and gradients equal a
    float32 GPT-2 holding the same float16-rounded weights), and training runs."""
    model, batch = gpt2()
    ref = copy.deepcopy(model)
    policy = unimp.load("fp16_master").replace(compute_dtype="float32")
    amp = unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), 1e-3))
    low = dict(model.named_parameters())
    assert low["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float16
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(low[name].float())
    loss = amp.model(**batch).loss
    want = ref(**batch).loss
    assert loss.dtype == torch.float32 and torch.equal(loss, want), (loss, want)
    amp.backward(loss)
    want.backward()
    for name, p in ref.named_parameters():
        assert low[name].grad.dtype == low[name].dtype
        scaled = (p.grad * amp.scale).to(low[name].dtype)
        assert torch.equal(low[name].grad, scaled), name
    amp.optimizer.step()
    amp.optimizer.zero_grad()
    rows = {r.path: r for r in amp.report().rows}
    assert (rows["transformer.h.0.mlp.c_fc"].compute_dtype, rows["transformer.h.0.mlp.c_fc"].param_dtype) \
        == ("float32", "float16")
    for _ in range(3):
        loss = amp.model(**batch).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
    assert torch.isfinite(loss)
    amp.remove()


# ---------------------------------------------------------------- entry points other than forward
class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """(aten op, output dtype) of every matmul/conv op that runs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("mm", "bmm", "addmm", "baddbmm", "convolution"):
            self.ops.append((func.__name__, (out[0] if isinstance(out, tuple | list) else out).dtype))
        return out


def t5_generate():
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return (transformers.T5ForConditionalGeneration(cfg).eval(),
            lambda m: m.generate(input_ids=IDS[:2, :7], max_new_tokens=4, do_sample=False, num_beams=1))


def clip_image_features():
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "image_size": 16, "patch_size": 8, "num_channels": 3}, projection_dim=16)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return transformers.CLIPModel(cfg).eval(), lambda m: m.get_image_features(pixel_values=pixels)


ENTRY_POINTS = {"hf_t5_generate": t5_generate, "hf_clip_get_image_features": clip_image_features}


@pytest.mark.parametrize("preset", list(NATIVE))
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_hf_entry_point(name, preset, cell):
    """``generate()`` (which runs ``get_encoder()(...)`` itself) and CLIP's feature method run under
    the policy: every matmul/conv in the dtype native ``torch.autocast`` around the same call runs it
    (on the model in the preset's parameter dtype), and, for torch's own CPU autocast, the same output."""
    c = cell("torch", name, preset)
    model, call = ENTRY_POINTS[name]()
    dtype = NATIVE[preset]
    native = copy.deepcopy(model).to(LOW_PARAMS.get(preset, torch.float32))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None), \
            _OpLog() as ref:
        want = call(native)
    amp = unimp.apply(preset, model)
    with torch.no_grad(), _OpLog() as got:
        out = call(amp.model)
    amp.remove()
    assert ref.ops and got.ops == ref.ops, (got.ops, ref.ops)
    c.check("entry point", f"{len(got.ops)} matmul/conv ops in the dtypes of native autocast around the call")
    if preset in ("fp32", "torch_autocast_cpu"):
        assert torch.equal(getattr(out, "pooler_output", out), getattr(want, "pooler_output", want))
        c.check("output", "equal to native autocast around the call")
