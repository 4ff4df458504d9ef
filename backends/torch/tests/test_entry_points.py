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


# ---------------------------------------------------------------- amp.report() after an entry point (issue 32)

def pegasus():
    cfg = transformers.PegasusConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                                     decoder_start_token_id=0)
    return transformers.PegasusForConditionalGeneration(cfg), {"input_ids": torch.randint(2, 64, (2, 7))}


def mamba():
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2,
                                   conv_kernel=4, time_step_rank=4)
    return transformers.MambaForCausalLM(cfg), {"input_ids": torch.randint(2, 64, (2, 7))}


class WeightLog(torch.overrides.TorchFunctionMode):
    """Output dtype of the first computation that takes each module's weight (or a view of it: squeeze,
    unsqueeze) as an argument, under native autocast: what a layer computed in when its parent used its
    weight directly."""

    VIEWS = ("squeeze", "unsqueeze", "view", "t", "transpose")

    def __init__(self, model):
        super().__init__()
        self.weights = {id(m.weight): path for path, m in model.named_modules()
                        if isinstance(getattr(m, "weight", None), torch.Tensor)}
        self.views, self.dtypes = {}, {}

    def _view(self, a):
        seen = self.views.get(id(a))
        return seen[1] if seen is not None and seen[0] is a else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        paths = [self.weights.get(id(a)) or self._view(a) for a in args]
        path = next((p for p in paths if p), None)
        if path is not None and isinstance(out, torch.Tensor):
            if getattr(func, "__name__", "") in self.VIEWS:
                self.views[id(out)] = (out, path)  # kept alive: a freed view's id is reused by other tensors
            else:
                self.dtypes.setdefault(path, out.dtype)
        return out


def _native_module_dtypes(model, call):
    """Per module, the output dtype of its last call (hooks) under native autocast around ``call``."""
    seen, handles = {}, []
    for path, m in model.named_modules():
        def hook(_m, _a, out, path=path):
            first = out[0] if isinstance(out, tuple | list) else out
            if isinstance(first, torch.Tensor) and first.is_floating_point():
                seen[path] = unimp.dtypes.dtype_name(first.dtype)
        handles.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            call(model)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_report_after_generate_lists_every_layer_that_ran_encoder_included():
    """HF Pegasus: generate() runs the encoder once (get_encoder()(...)), then the decoder per token; the
    report after it lists the encoder's rows too (they were '-': only the first forward was observed), with
    the dtypes native autocast gives each layer, and says which call the rows come from."""
    torch.manual_seed(0)
    model, inputs = pegasus()
    model.eval()
    call = lambda m: _generate(m, inputs)
    native = _native_module_dtypes(copy.deepcopy(model), call)
    assert any(p.startswith("model.encoder.layers") for p in native)
    amp = unimp.apply("torch_autocast_cpu", model)
    call(amp.model)
    report = amp.report()
    rows = {r.path: r for r in report.rows}
    encoder = [p for p in rows if p.startswith("model.encoder.") and p in native]
    assert encoder and all(rows[p].output_dtype == native[p] for p in encoder), \
        {p: (rows[p].output_dtype, native[p]) for p in encoder}
    ran = [p for p in rows if p in native]
    assert all(rows[p].output_dtype == native[p] for p in ran)
    assert rows["model.encoder.layers.0.fc1"].compute_dtype == "bfloat16"
    assert "rows observed during the first call after apply: model.generate()" in str(report)
    amp.remove()


def test_report_fills_layers_whose_weights_their_parent_uses_mamba():
    """HF Mamba's mixer computes with ``self.conv1d.weight`` (F.conv1d) and ``self.dt_proj.weight @ x``
    without calling those modules: their report rows carry the dtype native autocast computes those ops in
    (they were empty)."""
    torch.manual_seed(0)
    model, inputs = mamba()
    model.eval()
    ref = copy.deepcopy(model)
    log = WeightLog(ref)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), log:
        _generate(ref, inputs)
    amp = unimp.apply("torch_autocast_cpu", model)
    _generate(amp.model, inputs)
    rows = {r.path: r for r in amp.report().rows}
    for layer in ("backbone.layers.0.mixer.conv1d", "backbone.layers.0.mixer.dt_proj"):
        want = unimp.dtypes.dtype_name(log.dtypes[layer])
        assert (rows[layer].compute_dtype, rows[layer].output_dtype) == (want, want), (layer, rows[layer])
    amp.remove()
