"""``amp.watch()`` on real training steps of a tiny HF GPT-2 under ``mixed_fp16``.

Overflows are planted: a layer's weight scaled at a known step so its fp16 output passes 65504 (the
forward), or a gradient amplifier in place of a known layer (the backward). The expected layer, pass and
step are the planted ones; the statistics are checked against plain torch on the same tensors, captured
by this file's own hooks, with classes from torch's own cast to float16 (``Tensor.to``) and ``torch.finfo``.
"""

from __future__ import annotations

import copy
import math
import pickle
import warnings

import pytest
import torch
import transformers

import unimp
import unimp_torch.watch
from unimp.watch import read_records

FC = "transformer.h.1.mlp.c_fc"  # where the forward overflow is planted
AMPLIFIER = "transformer.h.1.mlp.dropout"  # where the backward overflow is planted
F16 = torch.finfo(torch.float16)


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


class _Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.save_for_backward(factor)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (factor,) = ctx.saved_tensors
        return grad * factor, None  # in the gradient's dtype (float16 here): overflows past 65504


class Amplifier(torch.nn.Module):
    """Identity forward; the backward multiplies the gradient by ``factor`` (1 until armed; a buffer, so
    arming it changes no Python value a compiled graph would be specialised on)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("factor", torch.ones(()))

    def forward(self, x):
        return _Amplify.apply(x, self.factor)


def train(amp, steps, plant=None, run=None):
    """``steps`` training steps; ``plant(step)`` runs before each (sets or removes the planted fault)."""
    run = amp.model if run is None else run
    for step in range(steps):
        if plant is not None:
            plant(step)
        loss = run(input_ids=IDS, labels=IDS).loss
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()


def scale_fc_at(model, k, factor=1e6):
    """The forward overflow: ``FC``'s weight times ``factor`` for step ``k`` only."""
    weight = model.get_submodule(FC).weight

    def plant(step):
        with torch.no_grad():
            if step == k:
                weight.mul_(factor)
            elif step == k + 1:
                weight.div_(factor)

    return plant


def amplify_at(model, k, factor=1e6):
    amplifier = Amplifier()
    model.transformer.h[1].mlp.dropout = amplifier

    def plant(step):
        amplifier.factor.fill_(factor if step == k else 1.0)

    return plant


def apply(model, policy="mixed_fp16"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # float16 emulated on this CPU; the tiny dims are not multiples of 8
        return unimp.apply(policy, model, torch.optim.AdamW(model.parameters(), 1e-3))


# ------------------------------------------------------------------ where the first non-finite value appeared


def test_a_forward_overflow_names_the_layer_and_the_forward():
    model = gpt2()
    amp = apply(model)
    watch = amp.watch(every=100, localize=True)
    train(amp, 5, scale_fc_at(model, 3))
    assert amp.skipped_steps == 1
    (skipped,) = watch.skipped
    assert skipped["step"] == 3 and not skipped["sampled"]
    assert skipped["first_nonfinite"] == {"path": FC, "direction": "forward", "tensor": "output", "exact": True}
    assert [r["step"] for r in watch.records] == [0, 3]  # the first step is sampled, then every 100
    amp.remove()


def test_a_backward_overflow_names_the_layer_and_the_backward():
    model = gpt2()
    plant = amplify_at(model, 2)
    amp = apply(model)
    watch = amp.watch(every=100, localize=True)
    train(amp, 4, plant)
    (skipped,) = watch.skipped
    assert skipped["step"] == 2
    assert skipped["first_nonfinite"] == {"path": AMPLIFIER, "direction": "backward", "tensor": "grad_input",
                                          "exact": True}
    amp.remove()


def test_the_planted_gradient_overflow_is_real():
    """The reference for the test above: in plain torch autocast, the amplified gradient is inf where it leaves
    the planted layer and finite where it arrives."""
    model = gpt2()
    amplify_at(model, 0)(0)
    seen = {}
    model.get_submodule(AMPLIFIER).register_full_backward_hook(
        lambda m, gin, gout: seen.update(gin=gin[0], gout=gout[0]))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=IDS, labels=IDS).loss
    (loss * 65536.0).backward()
    assert torch.isfinite(seen["gout"]).all() and not torch.isfinite(seen["gin"]).all()


class Block(torch.nn.Module):
    """A pre-norm GPT block from torch.nn (one graph under torch.compile, unlike HF's GPT-2 here)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.act, self.out = torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        self.drop = Amplifier()

    def forward(self, x):
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.drop(self.out(self.act(self.fc(self.ln_2(x)))))


class TinyGPT(torch.nn.Module):
    def __init__(self, vocab: int = 128, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.h = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def test_under_torch_compile_overflows_are_named_in_both_directions():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = TinyGPT()
    amp = apply(model)
    run = torch.compile(amp.model, backend="aot_eager")  # dynamo and AOT autograd trace the hooks
    counters.clear()

    def step():
        logits = run(IDS)
        amp.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), IDS.flatten()))
        amp.optimizer.step()
        amp.optimizer.zero_grad()

    step()  # traced before the watch: traced again with its hooks
    twin = copy.deepcopy(amp)  # the same step in eager, for the sampled statistics
    with pytest.warns(unimp.UnimpWarning, match=r"torch.compiler.reset\(\)"):
        watch = amp.watch(every=100, localize=True)
    eager = twin.watch(every=100)
    twin.backward(torch.nn.functional.cross_entropy(twin.model(IDS).float().flatten(0, 1), IDS.flatten()))
    twin.optimizer.step()
    fc, amplifier = model.h[1].fc, model.h[1].drop
    for k in range(6):
        with torch.no_grad():
            fc.weight.mul_(1e6) if k == 2 else fc.weight.div_(1e6) if k == 3 else None
        amplifier.factor.fill_(1e6 if k == 4 else 1.0)
        step()
    assert [(r["step"], r["sampled"], r["skipped"]) for r in watch.records] == [
        (1, True, False), (3, False, True), (5, False, True)]
    assert [r["first_nonfinite"] for r in watch.skipped] == [
        {"path": "h.1.fc", "direction": "forward", "tensor": "output", "exact": True},
        {"path": "h.1.drop", "direction": "backward", "tensor": "grad_input", "exact": True}]
    # the compiled backward measures through its probe what the eager hooks measure
    # (the same tensors: the order may differ where two layers share one, e.g. the model's output and head's)
    shape = sorted((s["path"], s["tensor"], s["dtype"], s["numel"]) for s in watch.records[0]["layers"])
    assert shape == sorted((s["path"], s["tensor"], s["dtype"], s["numel"]) for s in eager.records[0]["layers"])
    assert ("h.0.fc", "grad_output", "float16", IDS.numel() * 128) in shape
    assert not counters["graph_break"], dict(counters["graph_break"])  # the watch traced in, no graph break
    amp.remove()
    twin.remove()


def test_without_localize_a_skipped_step_is_located_from_the_loss_and_the_parameter_gradients():
    model = gpt2()
    amp = apply(model)
    watch = amp.watch(every=100)  # localize=False: no hook on steps 1..99
    train(amp, 3, scale_fc_at(model, 1))
    (skipped,) = watch.skipped
    # a forward overflow makes the scaled loss non-finite: that is the first thing checked on such a step
    assert skipped["first_nonfinite"] == {"path": "<loss>", "direction": "loss", "tensor": "loss", "exact": True}
    amp.remove()

    model = gpt2()
    plant = amplify_at(model, 1)
    amp = apply(model)
    watch = amp.watch(every=100)
    train(amp, 3, plant)
    (skipped,) = watch.skipped
    # the first layer in gradient-arrival order whose own parameter gradients are not finite: the planted
    # layer has none, the one feeding it (c_proj, in the same MLP) is next
    assert skipped["first_nonfinite"] == {"path": "transformer.h.1.mlp.c_proj", "direction": "backward",
                                          "tensor": "grad_param", "exact": False}
    amp.remove()


# ------------------------------------------------------------------ the statistics, against plain torch


def _reference(x: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Classes of ``x`` cast to ``dtype`` by torch itself (``Tensor.to``; a tensor already in it stays as it is)."""
    x = x.detach()
    n = x.numel()
    finite = torch.isfinite(x)
    y = x.to(dtype)
    ok = finite & torch.isfinite(y)
    return {"amax": float(torch.where(finite, x.abs(), 0).amax()), "nonfinite": float((~finite).sum()) / n,
            "overflow": float((torch.isinf(y) & ~torch.isnan(x)).sum()) / n,
            "underflow": float(((y == 0) & (x != 0) & ok).sum()) / n,
            "subnormal": float(((y != 0) & (y.abs() < torch.finfo(dtype).smallest_normal) & ok).sum()) / n,
            "zero": float((x == 0).sum()) / n, "numel": n}


# the layers' compute dtypes under mixed_fp16, from the policy's op lists: linear lowered to float16,
# layer_norm in float32, embedding in none (it follows its float32 parameters)
WATCHED = {FC: torch.float16, "transformer.h.0.attn.c_attn": torch.float16, "lm_head": torch.float16,
           "transformer.h.0.ln_2": torch.float32, "transformer.wte": torch.float32}


def _capture(model):
    """This test's own hooks: every output and output gradient of the WATCHED layers, per step."""
    got: dict[tuple[str, str], torch.Tensor] = {}

    def forward_hook(path):
        def hook(module, args, out):
            got[path, "output"] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g: got.__setitem__((path, "grad_output"), g.detach().clone()))
        return hook

    for path in WATCHED:
        model.get_submodule(path).register_forward_hook(forward_hook(path))
    return got


@pytest.mark.parametrize("counting", ["per bound (CPU)", "at once (accelerators)", "at once, in chunks",
                                      "compiled (CUDA)"])
def test_sampled_statistics_match_plain_torch_on_the_same_tensors(counting, monkeypatch):
    if counting.startswith("at once"):  # the GPU's eager counting without a compiler, run here on the CPU
        monkeypatch.setattr(unimp_torch.watch, "_COUNTED_PER_BOUND", frozenset())
    if counting.startswith("compiled"):  # CUDA's eager counting: one torch.compile'd kernel, here inductor's CPU one
        monkeypatch.setattr(unimp_torch.watch, "_COUNTED_FUSED", frozenset({"cpu"}))
        monkeypatch.setattr(unimp_torch.watch, "_FUSED", [])
    if counting.endswith("chunks"):  # a tensor larger than a chunk: counted chunk by chunk
        monkeypatch.setattr(unimp_torch.watch, "_CHUNK", 1000)
    model = gpt2()
    amp = apply(model)
    watch = amp.watch(every=2)
    got = _capture(model)
    plant = scale_fc_at(model, 2, factor=3e5)  # step 2 is sampled: part of FC's output overflows, not all

    expected = {}
    for step in range(4):
        plant(step)
        got.clear()
        train(amp, 1)
        # each tensor in its layer's compute dtype
        expected[step] = {k: (_reference(v, WATCHED[k[0]]), WATCHED[k[0]]) for k, v in got.items()}
    assert [r["step"] for r in watch.records] == [0, 2]
    assert [r["skipped"] for r in watch.records] == [False, True]
    for record in watch.records:
        rows = {(s["path"], s["tensor"]): s for s in record["layers"]}
        for key, (ref, dtype) in expected[record["step"]].items():
            if key not in rows:  # a skipped step's backward: nothing sampled where no gradient arrived
                continue
            row = rows[key]
            assert row["dtype"] == str(dtype).removeprefix("torch.")
            for stat, value in ref.items():
                assert row[stat] == value, (record["step"], key, stat, row[stat], value)
    fc = {(s["path"], s["tensor"]): s for s in watch.records[1]["layers"]}[FC, "output"]
    assert 0 < fc["overflow"] < 1 and fc["nonfinite"] == fc["overflow"]  # the plant: some values past 65504
    ln2 = {(s["path"], s["tensor"]): s for s in watch.records[0]["layers"]}["transformer.h.0.ln_2", "output"]
    assert ln2["numel"] == IDS.numel() * 32
    if counting.startswith("compiled"):
        assert unimp_torch.watch._FUSED[0] is not None  # it ran compiled, not its eager fallback
    amp.remove()


def test_records_come_only_from_sampled_and_skipped_steps_and_hooks_only_on_those_steps(tmp_path):
    model = gpt2()
    amp = apply(model)
    fc = model.get_submodule(FC)
    watch = amp.watch(every=3, path=tmp_path / "numerics.jsonl")
    plant = scale_fc_at(model, 4)
    hooked = []
    for step in range(8):
        plant(step)
        hooked.append(bool(fc._forward_hooks))
        train(amp, 1)
    assert hooked == [True, False, False, True, False, False, True, False]  # no hook on an unsampled step
    assert [(r["step"], r["sampled"], r["skipped"]) for r in watch.records] == [
        (0, True, False), (3, True, False), (4, False, True), (6, True, False)]
    assert read_records(tmp_path / "numerics.jsonl") == watch.records
    report = amp.report()
    assert report.numerics["sampled_steps"] == 3 and report.numerics["skipped_steps"] == 1
    text = str(report)
    assert "numerics: 3 sampled steps" in text
    assert "skipped step 4: first non-finite value in loss: the scaled loss" in text
    watch.close()
    assert not fc._forward_hooks and not fc._forward_pre_hooks
    assert not any(amp.iteration.listeners)  # the watch no longer listens to the loss scale's updates
    train(amp, 3)
    assert len(watch.records) == 4  # closed: nothing more recorded
    assert amp.report().numerics["sampled_steps"] == 3  # its numerics stay in the report
    amp.remove()


# ------------------------------------------------------------------ FP8 layers


def test_fp8_layers_are_measured_in_their_formats():
    torchao = pytest.importorskip("torchao")
    del torchao
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    amp = apply(model, "fp8_tensorwise")
    fp8_layers = amp.fp8_layers
    if not fp8_layers:
        pytest.skip(f"no layer runs FP8 here: {amp.report().notes}")
    path = next(iter(fp8_layers))
    seen = {}

    def pre(module, args):
        seen["input"] = args[0].detach().clone()

    def post(module, args, out):
        out.register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))

    model.get_submodule(path).register_forward_pre_hook(pre)
    model.get_submodule(path).register_forward_hook(post)
    watch = amp.watch(every=1)
    x = torch.randn(16, 32)
    amp.backward(amp.model(x).float().square().mean())
    amp.optimizer.step()
    rows = {(s["path"], s["tensor"]): s for s in watch.records[0]["layers"]}
    for tensor, source, fmt in (("fp8_input", "input", torch.float8_e4m3fn),
                                ("fp8_grad_output", "grad", torch.float8_e5m2)):
        row = rows[path, tensor]
        assert row["dtype"] == str(fmt).removeprefix("torch.")
        x = seen[source].float()
        amax = x.abs().amax()
        y = (x * (torch.finfo(fmt).max / amax)).to(fmt).float()  # torch's tensorwise FP8 cast
        n = x.numel()
        assert row["amax"] == float(amax)
        assert row["underflow"] == float(((y == 0) & (x != 0)).sum()) / n
        assert row["subnormal"] == float(((y != 0) & (y.abs() < torch.finfo(fmt).smallest_normal)).sum()) / n
        assert row["overflow"] == 0.0  # scaled to the format's max
    amp.remove()


# ------------------------------------------------------------------ the handle's contract


def test_bad_use_is_refused_with_the_fix(tmp_path):
    model = gpt2()
    amp = apply(model)
    with pytest.raises(ValueError, match="every=0"):
        amp.watch(every=0)
    with pytest.raises(ValueError, match="does not exist"):
        amp.watch(path=tmp_path / "no" / "x.jsonl")
    watch = amp.watch()
    with pytest.raises(unimp.UnsupportedError, match="already running.*amp.unwatch"):
        amp.watch()
    assert amp.unwatch() is watch and watch.closed
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(unimp.UnsupportedError, match="pip install tensorboard"):
            amp.watch(tensorboard=tmp_path / "tb")
        assert amp._watch is watch  # nothing started
    else:
        tb = amp.watch(every=1, tensorboard=tmp_path / "tb")
        train(amp, 2)
        tb.close()
        assert any((tmp_path / "tb").iterdir())
    amp.remove()
    with pytest.raises(unimp.StateError, match="removed"):
        amp.watch()

    no_optimizer = unimp.apply("mixed_bf16", torch.nn.Linear(8, 8))
    with pytest.raises(unimp.UnsupportedError, match="apply the policy with the optimizer"):
        no_optimizer.watch()
    no_optimizer.remove()


def test_remove_and_copies_leave_no_watch_behind():
    model = gpt2()
    amp = apply(model)
    watch = amp.watch(every=1)
    train(amp, 1)
    twin = copy.deepcopy(amp)  # the copy is not watched, its model's hooks are inert
    clone = pickle.loads(pickle.dumps(model))
    train(twin, 2)
    with torch.no_grad():
        clone(input_ids=IDS)
    assert len(watch.records) == 1 and twin._watch is None and not any(twin.iteration.listeners)
    original = type(model).forward
    amp.remove()
    assert watch.closed
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert "forward" not in model.__dict__ and type(model).forward is original
    twin.remove()


def test_evaluation_forwards_are_not_recorded():
    model = gpt2()
    amp = apply(model)
    watch = amp.watch(every=1, localize=True)
    with torch.no_grad():
        amp.model(input_ids=IDS)
    amp.report(input_ids=IDS)  # a no-grad forward of its own
    train(amp, 1)
    (record,) = watch.records
    fc = [s for s in record["layers"] if s["path"] == FC and s["tensor"] == "output"]
    assert len(fc) == 1 and fc[0]["numel"] == IDS.numel() * 128  # one training forward's worth
    assert math.isfinite(record["scale"])
    amp.remove()
