"""The policy holds for every entry point into the model, not only ``forward`` (issue 27 item 13).

HF ``generate()`` on encoder-decoder models calls ``self.get_encoder()(...)`` directly
(transformers/generation/utils.py: ``_prepare_encoder_decoder_kwargs_for_generation``), and
``CLIPModel.get_image_features``/``get_text_features`` call the towers and projections themselves
(transformers/models/clip/modeling_clip.py): none of it goes through ``model.forward``. The oracle
is native ``with torch.autocast("cpu", dtype):`` around the same call on the same model: every
matmul/conv op runs in the same dtype (a TorchDispatchMode op log), and the outputs are equal.
Small random-init configs, no downloads.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import unimp

transformers = pytest.importorskip("transformers")

COMPUTE_OPS = ("mm", "bmm", "addmm", "baddbmm", "convolution", "_scaled_dot_product", "linear", "matmul")


class OpLog(TorchDispatchMode):
    """(aten op, output dtype) of every matmul/conv op that runs, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0].startswith(COMPUTE_OPS):
            first = out[0] if isinstance(out, tuple | list) else out
            self.ops.append((func.__name__, first.dtype))
        return out


def t5():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": torch.randint(2, 64, (2, 7))}


def bart():
    cfg = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1,
                                  bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)
    return transformers.BartForConditionalGeneration(cfg), {"input_ids": torch.randint(3, 64, (2, 7))}


def whisper():
    cfg = transformers.WhisperConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                     max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[])
    return transformers.WhisperForConditionalGeneration(cfg), {"input_features": torch.randn(2, 8, 32)}


GENERATORS = {"t5": t5, "bart": bart, "whisper": whisper}
# torch_autocast_cpu is native CPU autocast itself; mixed_bf16 adds unimp's op rules on top of it
POLICIES = {"mixed_bf16": torch.bfloat16, "torch_autocast_cpu": torch.bfloat16}


def _generate(model, inputs):
    return model.generate(**inputs, max_new_tokens=4, do_sample=False, num_beams=1)


def _native(model, dtype, call):
    with torch.autocast("cpu", dtype=dtype), OpLog() as log:
        out = call(model)
    return out, log.ops


def _unimp(policy, model, call):
    amp = unimp.apply(policy, model)
    try:
        with OpLog() as log:
            out = call(amp.model)
    finally:
        amp.remove()
    return out, log.ops


@pytest.mark.parametrize("policy", ["torch_autocast_cpu", "mixed_bf16"])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_generate_runs_the_encoder_under_the_policy(name, policy):
    torch.manual_seed(0)
    model, inputs = GENERATORS[name]()
    model.eval()
    call = lambda m: _generate(m, inputs)
    ref, ref_ops = _native(model, POLICIES[policy], call)
    got, ops = _unimp(policy, model, call)
    assert ref_ops and all(d == torch.bfloat16 for _, d in ref_ops)
    assert ops == ref_ops
    assert torch.equal(got, ref)


@pytest.mark.parametrize("name", list(GENERATORS))
def test_generate_under_pure_bf16_runs(name):
    """pure_bf16 (bf16 params, fp32 norms): generate no longer fails with a dtype error in the encoder;
    its matmuls run in bf16 as those of native autocast around generate on the bf16 model."""
    torch.manual_seed(0)
    model, inputs = GENERATORS[name]()
    model.eval()
    call = lambda m: _generate(m, inputs)
    _, ref_ops = _native(copy.deepcopy(model).bfloat16(), torch.bfloat16, call)
    got, ops = _unimp("pure_bf16", model, call)
    assert [op for op, _ in ops] == [op for op, _ in ref_ops]
    assert all(d == torch.bfloat16 for _, d in ops)
    assert got.shape[0] == 2


def clip():
    cfg = transformers.CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 4, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                       "image_size": 16, "patch_size": 8, "num_channels": 3},
        projection_dim=16)
    return transformers.CLIPModel(cfg)


@pytest.mark.parametrize("policy", ["torch_autocast_cpu", "mixed_bf16"])
@pytest.mark.parametrize("method", ["get_image_features", "get_text_features"])
def test_clip_feature_methods_run_under_the_policy(method, policy):
    torch.manual_seed(0)
    model = clip().eval()
    inputs = ({"pixel_values": torch.randn(2, 3, 16, 16)} if method == "get_image_features"
              else {"input_ids": torch.randint(0, 64, (2, 8))})
    call = lambda m: getattr(m, method)(**inputs)
    with torch.no_grad():
        ref, ref_ops = _native(model, POLICIES[policy], call)
        got, ops = _unimp(policy, model, call)
    assert ref_ops and ops == ref_ops
    ref = getattr(ref, "pooler_output", ref)
    got = getattr(got, "pooler_output", got)
    assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_methods_are_restored_by_remove_and_torch_methods_are_left_alone():
    torch.manual_seed(0)
    model = clip()
    amp = unimp.apply("mixed_bf16", model)
    assert "get_image_features" in model.__dict__ and "forward" in model.__dict__
    assert not {"to", "state_dict", "train", "parameters"} & set(model.__dict__)
    amp.remove()
    assert "get_image_features" not in model.__dict__ and "forward" not in model.__dict__


def test_copies_and_pickles_run_their_own_entry_points():
    """copy.deepcopy / torch.save of the applied model: the copy's generate runs the copy's weights
    under the policy (as forward does), with the same result."""
    import io

    torch.manual_seed(0)
    model, inputs = t5()
    model.eval()
    amp = unimp.apply("mixed_bf16", model)
    want = _generate(model, inputs)
    copied = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    amp.remove()
    for other in (copied, loaded):
        assert other.__dict__["generate"].forward.module is other
        with OpLog() as log:
            got = _generate(other, inputs)
        assert torch.equal(got, want) and all(d == torch.bfloat16 for _, d in log.ops)
