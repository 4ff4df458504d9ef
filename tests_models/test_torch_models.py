"""HF transformers GPT-2 / BERT (tiny configs, random init) under the torch presets; timm/torchvision n/a."""

import copy

import pytest
import torch
import transformers

import unimp

STEPS = 10
G = torch.Generator().manual_seed(0)
IDS = torch.randint(0, 64, (4, 12), generator=G)
CLS = torch.randint(0, 3, (4,), generator=G)
# preset -> (hand-written torch AMP: autocast dtype or None for plain fp32; relative loss tolerance; 0 = bit-identical)
NATIVE = {"fp32": (None, 0.0), "torch_autocast_cpu": (torch.bfloat16, 0.0), "mixed_bf16": (torch.bfloat16, 2e-2),
          "mixed_fp16": (torch.float16, 1e-3), "pure_bf16": (torch.bfloat16, 1e-3),
          "fp16_master": (torch.float16, 1e-3)}
# presets with low-precision parameters: the hand-written reference keeps fp32 masters by hand
LOW_PARAMS = {"pure_bf16": torch.bfloat16, "fp16_master": torch.float16}
NO_TORCHVISION = ("needs torchvision: PyPI's only torchvision for torch 2.13 (0.28.0) is the CUDA build; with CPU "
                  "torch its ops library does not load (`operator torchvision::nms does not exist`) and it breaks "
                  "`import transformers`")


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


def train_native(model, batch, dtype, params=None):
    """torch's own AMP written by hand: autocast, and a GradScaler for float16. With ``params``
    (a low dtype): the model's parameters in that dtype except the LayerNorms', and fp32 master
    copies that the optimizer steps (apex O2 style: grads copied onto the masters, the masters
    copied back)."""
    unique = list({id(p): p for p in model.parameters()}.values())
    masters = unique
    if params is not None:
        masters = [torch.nn.Parameter(p.detach().clone()) for p in unique]
        keep = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
        for p in unique:
            if id(p) not in keep:
                p.data = p.data.to(params)
    opt = torch.optim.AdamW(masters, 1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        if params is not None:
            for p, m in zip(unique, masters):
                m.grad = p.grad.float()
                p.grad = None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if params is not None:
            with torch.no_grad():
                for p, m in zip(unique, masters):
                    p.copy_(m)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("preset", list(NATIVE))
@pytest.mark.parametrize("name", list(MODELS))
def test_hf_model(name, preset, cell, tmp_path):
    c = cell("torch", name, preset)
    model, batch = MODELS[name]()
    model.train()
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        before = model(**batch).logits
    amp = unimp.apply(preset, model)
    with torch.no_grad():
        amp.model(**batch)
    amp.remove()
    assert all(torch.equal(v, model.state_dict()[k]) and v.stride() == model.state_dict()[k].stride()
               for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(before, model(**batch).logits)
    c.check("remove", "untouched model bit for bit (state_dict values and strides, logits)")

    native = copy.deepcopy(model)
    amp = unimp.apply(preset, model, torch.optim.AdamW(model.parameters(), 1e-3))
    losses = []
    for _ in range(STEPS):
        loss = amp.model(**batch).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
    dtype, tol = NATIVE[preset]
    low = LOW_PARAMS.get(preset)
    want = train_native(native, batch, dtype, low)
    what = "plain float32" if dtype is None else f"hand-written torch.autocast('cpu', {dtype})"
    what += " + GradScaler" if dtype == torch.float16 else ""
    what += f" with {low} weights (LayerNorms fp32) and fp32 masters by hand" if low else ""
    if tol == 0.0:
        assert losses == want, (losses, want)
        c.check("loss", f"{STEPS} steps, bit-identical to {what}")
    else:
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
        assert rel <= tol, (losses, want)
        c.check("loss", f"{STEPS} steps vs {what}: max rel diff {rel:.1e} (tolerance {tol:g})")

    # report rows vs output dtypes seen by forward hooks registered here
    report = amp.report()
    seen = {}

    def hook(path):
        def record(module, args, out):
            seen.setdefault(path, out.dtype if torch.is_tensor(out) else None)
        return record

    hooks = [m.register_forward_hook(hook(p)) for p, m in model.named_modules() if p and not list(m.children())]
    with torch.no_grad():
        amp.model(**batch)
    for h in hooks:
        h.remove()
    rows = [r for r in report.rows if seen.get(r.path) is not None and r.output_dtype]
    assert rows and all(r.output_dtype == str(seen[r.path]).replace("torch.", "") for r in rows), \
        [(r.path, r.output_dtype, seen[r.path]) for r in rows]
    c.check("report", f"{len(rows)} rows = output dtypes seen by forward hooks")

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


@pytest.mark.parametrize("name", ["timm_vit", "timm_resnet", "torchvision_resnet"])
def test_vision_models_need_torchvision(name, cell):
    try:
        import torchvision  # noqa: F401
        from torchvision.ops import nms  # noqa: F401
    except Exception:
        for preset in NATIVE:
            cell("torch", name, preset).data.update(status="n/a", why=NO_TORCHVISION)
        pytest.skip(NO_TORCHVISION)
    pytest.fail("a working torchvision is installed: write the timm/torchvision cells")


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
