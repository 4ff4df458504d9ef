"""The policy's forward: copies and pickles run their own weights, the first forward runs once,
BatchNorm overrides run, and functional calls of every op follow the policy (both directions)."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from models import ConvNet, mlp
from torch import nn

import unimp
from unimp.spi import Plan
from unimp_torch.plan import compile_plan

BF16, F32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("preset", ["mixed_bf16", "pure_bf16"])
def test_deepcopy_runs_its_own_weights(preset):
    model = mlp()
    amp = unimp.apply(preset, model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 16)
    amp.backward(amp.model(x).square().mean())
    amp.optimizer.step()
    before = amp.model(x)
    ema = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=BF16):  # the oracle: torch.autocast leaves the last Linear's bf16 output
        native = mlp()(x).dtype
    assert torch.equal(ema(x), before) and ema(x).dtype == before.dtype == native == BF16  # same weights, policy
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    assert ema(x).abs().max() < 1e-6  # the copy runs its own (zeroed) weights ...
    assert torch.equal(amp.model(x), before)  # ... and the original is untouched
    amp.remove()
    assert torch.equal(ema(x), torch.zeros_like(before))  # still its own after the original's remove


def test_pickle_and_torch_save_keep_the_policy():
    model = ConvNet()
    amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(2, 3, 8, 8)
    expected = amp.model(x)
    loaded = pickle.loads(pickle.dumps(model))
    assert torch.equal(loaded(x), expected)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    assert torch.equal(saved(x), expected)
    with pytest.raises(RuntimeError, match="copy of a model with a unimp policy applied"):
        unimp.apply("mixed_bf16", saved)
    amp.remove()


class Dropped(ConvNet):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1)))


def test_first_forward_runs_the_model_once():
    # torch_autocast_cpu is plain torch.autocast: the first step must be native autocast's, bit for bit
    torch.manual_seed(0)
    native, ours = Dropped(), Dropped()
    ours.load_state_dict(native.state_dict())
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=BF16):
        expected = native(x)
    amp = unimp.apply("torch_autocast_cpu", ours, torch.optim.SGD(ours.parameters(), lr=0.1))
    torch.manual_seed(1)
    out = amp.model(x)
    assert torch.equal(out.float(), expected.float())  # same dropout mask: the RNG was drawn once
    assert int(ours.bn.num_batches_tracked) == 1
    assert torch.equal(ours.bn.running_mean, native.bn.running_mean)
    assert torch.equal(ours.bn.running_var, native.bn.running_var)
    assert amp.report().row("bn").output_dtype == "bfloat16"  # ... and it was observed
    amp.remove()


def test_report_with_an_input_leaves_no_trace():
    model = Dropped()
    amp = unimp.apply("mixed_bf16", model)
    stats = model.bn.running_mean.clone()
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    assert amp.report(torch.randn(2, 3, 8, 8)).row("bn").kind == "batch_norm"
    assert torch.equal(model.bn.running_mean, stats) and int(model.bn.num_batches_tracked) == 0
    amp.remove()
    torch.manual_seed(3)
    assert torch.equal(torch.rand(1), expected)


def _native_bn_override(model: ConvNet, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Native torch: autocast, with the BatchNorm's input cast by hand to ``dtype``."""
    with torch.autocast("cpu", dtype=BF16):
        h = model.bn(model.conv(x).to(dtype))
        return model.head(model.pool(torch.relu(h)).flatten(1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_batch_norm_override_to_low_precision_trains(dtype):
    policy = {"extends": "torch_autocast_cpu", "overrides": [{"types": ["BatchNorm2d"], "compute_dtype": dtype}]}
    try:
        compile_plan(Plan.request(unimp.load(policy), "torch"), device="cpu")
    except unimp.UnsupportedError:
        pytest.skip(f"torch CPU autocast does not take {dtype} here")
    torch.manual_seed(0)
    native, ours = ConvNet(), ConvNet()
    ours.load_state_dict(native.state_dict())
    x = torch.randn(4, 3, 8, 8)
    expected = _native_bn_override(native, x, getattr(torch, dtype))
    amp = unimp.apply(policy, ours, torch.optim.SGD(ours.parameters(), lr=0.1))
    out = amp.model(x)
    assert torch.equal(out.float(), expected.float())
    assert torch.equal(ours.bn.running_mean, native.bn.running_mean)
    assert amp.report().row("bn").output_dtype == dtype
    amp.backward(out.float().square().mean())
    amp.optimizer.step()
    assert ours.bn.weight.dtype == F32 and ours.bn.running_var.dtype == F32
    assert torch.isfinite(amp.model(x)).all()
    amp.remove()


class Functional(nn.Module):
    """Every op through its functional form (no nn.Linear/Conv2d/Softmax modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 8)
        self.k = nn.Parameter(torch.randn(4, 3, 3, 3) / 9)
        self.seen: dict[str, torch.dtype] = {}

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = torch.matmul(x, self.w)
        q = h.view(1, 1, 4, 8)
        a = F.scaled_dot_product_attention(q, q, q)
        c = F.conv2d(img, self.k)
        s = F.softmax(h, -1)
        n = F.layer_norm(h, (8,))
        loss = F.mse_loss(h, x)
        self.seen.update(matmul=h.dtype, attention=a.dtype, conv=c.dtype, softmax=s.dtype, layer_norm=n.dtype,
                         loss=loss.dtype, at=(q @ q.transpose(-1, -2)).dtype)
        return a.float().sum() + c.float().sum() + s.float().sum() + n.float().sum() + loss.float()


def _seen(policy):
    model = Functional()
    amp = unimp.apply(policy, model)
    amp.model(torch.randn(4, 8), torch.randn(1, 3, 6, 6))
    amp.remove()
    return model.seen


def test_functional_calls_follow_the_policy_both_directions():
    # torch's CPU autocast lowers matmul/sdpa/conv2d and keeps mse_loss in float32, in C++
    native = Functional()
    with torch.autocast("cpu", dtype=BF16):
        native(torch.randn(4, 8), torch.randn(1, 3, 6, 6))
    assert native.seen["matmul"] == native.seen["attention"] == native.seen["conv"] == BF16
    assert native.seen["loss"] == F32
    # a policy with them in float32: float32, functional calls and `@` included
    up = _seen({"extends": "mixed_bf16", "ops": {"float32": ["matmul", "attention", "conv", "softmax"],
                                                 "lower": ["linear"]}})
    assert up["matmul"] == up["attention"] == up["conv"] == up["at"] == F32
    # the reverse: ops torch runs in float32 (or follows inputs) lowered by the policy
    down = _seen({"extends": "mixed_bf16", "ops": {"lower": ["matmul", "attention", "conv", "softmax",
                                                             "layer_norm", "loss"], "float32": []}})
    assert down["matmul"] == down["attention"] == down["conv"] == BF16
    assert down["softmax"] == down["layer_norm"] == down["loss"] == BF16
    # and the Plan says so: every op is controlled at op level
    request = Plan.request(unimp.load({"extends": "mixed_bf16", "ops": {"float32": ["matmul"]}}), "torch")
    plan = compile_plan(request, device="cpu")
    assert plan.op("matmul").control == "op" and plan.details.op_moves["matmul"] == "float32"
    assert compile_plan(request, device="cuda").details.op_moves["matmul"] == "float32"


@pytest.mark.parametrize("output", ["unchanged", "float32"])
def test_output_dtype_unchanged_leaves_autocasts_dtype_and_float32_casts(output):
    """``unchanged``: the output of the last (lowered) Linear as torch.autocast gives it; ``float32``: cast."""
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=BF16):
        native = mlp()(x).dtype
    model = mlp()
    amp = unimp.apply(unimp.load("mixed_bf16").replace(output_dtype=output), model)
    assert native == BF16 and amp.model(x).dtype == (native if output == "unchanged" else F32)
    assert amp.report().row("<model>").output_dtype == ("bfloat16" if output == "unchanged" else "float32")
    amp.remove()
    assert model(x).dtype == F32


def _tensors(out, prefix=""):
    """Every tensor in a (nested) model output, by its position/key."""
    if isinstance(out, torch.Tensor):
        return {prefix: out}
    if isinstance(out, dict):
        items = out.items()
    elif isinstance(out, (list, tuple)):
        items = enumerate(out)
    else:
        return {}
    return {k: v for key, item in items for k, v in _tensors(item, f"{prefix}.{key}").items()}


def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=16))


@pytest.mark.parametrize("name", ["gpt2", "llama", "softmax"])
def test_torch_autocast_cpu_outputs_are_torch_autocasts(name):
    """The oracle: ``torch.autocast("cpu", bfloat16)`` on a copy of the same model, same inputs. Every output
    tensor (logits, hidden states, the loss; a softmax's probabilities) has autocast's dtype and values."""
    if name == "softmax":
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Softmax(-1))
        args, kwargs = (torch.randn(4, 16),), {}
    else:
        model = _hf(name)
        ids = torch.randint(0, 64, (2, 8))
        args, kwargs = (), {"input_ids": ids, "labels": ids, "output_hidden_states": True, "use_cache": False}
    model.eval()  # no dropout: the two forwards see the same values
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=BF16):
        native = _tensors(reference(*args, **kwargs))
    amp = unimp.apply("torch_autocast_cpu", model)
    ours = _tensors(amp.model(*args, **kwargs))
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in native.items()}
    assert any(v.dtype == BF16 for v in native.values())  # the last op's low output is not cast
    for k, v in native.items():
        assert torch.equal(ours[k], v), k
    amp.remove()
