"""Ops after a layer an override lowers (or raises) run as the Plan decides, on real HF models in training.

An override makes its layer's outputs another dtype than the rest of the model (``fp32`` with ``v_proj`` in
bfloat16; ``mixed_bf16`` with ``v_proj`` in float32 or float16), so the ops after it meet inputs of mixed or
unexpected dtypes. Each such op must run in the dtype the Plan decided for its canonical op (``lower``: the
compute dtype, ``float32``, ``promote``: the widest input), never end in torch's own assertion (``Expected
query, key, and value to have the same dtype``, ``at::autocast::prioritize``) nor silently run in the
override's dtype. A ``TorchFunctionMode`` written here (entered around the module that calls the ops, so it
sees their raw inputs before any rule acts) records each call; the test recomputes it by hand in plain torch
with explicit casts to the dtype the Plan names and compares.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import unimp
from unimp.dtypes import reference_tolerance

transformers = pytest.importorskip("transformers")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the torch functions watched, and the canonical op (docs/design.md section 3) each one is
CANONICAL = {"scaled_dot_product_attention": "attention", "matmul": "matmul", "softmax": "softmax",
             "cat": "concat", "layer_norm": "layer_norm", "linear": "linear"}
# ops torch's CPU autocast has no kernel for, which the Plan leaves to torch (they follow their inputs)
KEPT = {"mv", "dot", "tensordot", "bilinear", "cross"}


def llama(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = attn
    return transformers.LlamaForCausalLM(config)


def gpt2(attn: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)  # recomputable by hand
    config._attn_implementation = attn
    return transformers.GPT2LMHeadModel(config)


class Calls(TorchFunctionMode):
    """Each call of a watched torch function: its name, the function, its raw inputs and its result."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (name in CANONICAL or name in KEPT) and any(_floating(a) for a in (*args, *kwargs.values())):
            self.calls.append((name, func, _detach(args), _detach(kwargs), out.detach()))
        return out


def _floating(x) -> bool:
    if isinstance(x, list | tuple):
        return any(_floating(t) for t in x)
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _detach(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, list | tuple):
        return type(x)(_detach(t) for t in x)
    if isinstance(x, dict):
        return {k: _detach(v) for k, v in x.items()}
    return x


def _cast(x, dtype):
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, list | tuple):
        return type(x)(_cast(t, dtype) for t in x)
    return x


def _inputs(args, kwargs) -> list[torch.dtype]:
    out = []
    for a in (*args, *kwargs.values()):
        for t in a if isinstance(a, list | tuple) else (a,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                out.append(t.dtype)
    return out


def watch(module: torch.nn.Module) -> tuple[Calls, list]:
    """``Calls`` entered around every forward of ``module`` (innermost: it sees the ops' raw inputs)."""
    calls = Calls()

    def enter(module, args) -> None:
        calls.__enter__()

    def leave(module, args, out) -> None:
        calls.__exit__(None, None, None)

    return calls, [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def expected_dtype(plan, name: str, args, kwargs) -> torch.dtype:
    """The dtype the Plan decided for this call: its canonical op's dtype, or the widest input (promote)."""
    decision = plan.op(CANONICAL[name])
    if decision.dtype is not None:
        return DTYPES[decision.dtype]
    assert decision.requested == "promote", decision
    widest = None
    for d in _inputs(args, kwargs):
        widest = d if widest is None else torch.promote_types(widest, d)
    return widest


def check_calls(plan, calls: list, want: set[str]) -> list[tuple[str, torch.dtype]]:
    """Every recorded call of the ``want`` ops ran in the Plan's dtype and equals the same call by hand with
    explicit casts; each of them ran."""
    seen = []
    for name, func, args, kwargs, out in calls:
        if name not in want:  # e.g. the overridden layer's own F.linear, which runs in its override's dtype
            continue
        dtype = expected_dtype(plan, name, args, kwargs)
        with torch.autocast("cpu", enabled=False):  # plain torch: the inputs cast by hand, nothing else
            ref = func(*_cast(args, dtype), **_cast(kwargs, dtype))
        assert out.dtype == dtype, (name, [str(d) for d in _inputs(args, kwargs)], out.dtype, dtype)
        # the same kernels on the same cast inputs: one rounding of the op in its dtype at most
        tol = reference_tolerance(str(dtype).removeprefix("torch."), 1)
        rel = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
        assert rel <= tol, (name, rel, tol)
        seen.append((name, dtype))
    assert want <= {n for n, _ in seen}, (want, seen)
    return seen


# (id, model, policy it extends, overridden module, its compute dtype, module whose ops are watched,
#  the watched ops that must run, and the dtypes they must have run in where the inputs mix)
CASES = [
    # the report: float32 everywhere but v_proj; SDPA got float32 q/k and bfloat16 v
    ("llama-fp32-v_proj-bf16", llama, "fp32", "model.layers.0.self_attn.v_proj", "bfloat16",
     "model.layers.0.self_attn", {"scaled_dot_product_attention": torch.float32}),
    ("llama-eager-fp32-v_proj-bf16", lambda: llama("eager"), "fp32", "model.layers.0.self_attn.v_proj", "bfloat16",
     "model.layers.0.self_attn", {"matmul": torch.float32, "softmax": torch.float32}),
    # q_proj lowered: rotary's cat of two bfloat16 halves promotes to bfloat16 (the widest input), not float32
    ("llama-fp32-q_proj-bf16", llama, "fp32", "model.layers.0.self_attn.q_proj", "bfloat16",
     "model.layers.0.self_attn", {"cat": None, "scaled_dot_product_attention": torch.float32}),
    # all of q, k, v lowered by one layer: the attention still runs in float32 (it ran in bfloat16)
    ("gpt2-fp32-c_attn-bf16", gpt2, "fp32", "transformer.h.0.attn.c_attn", "bfloat16",
     "transformer.h.0.attn", {"scaled_dot_product_attention": torch.float32}),
    ("gpt2-eager-fp32-c_attn-bf16", lambda: gpt2("eager"), "fp32", "transformer.h.0.attn.c_attn", "bfloat16",
     "transformer.h.0.attn", {"matmul": torch.float32, "softmax": torch.float32}),
    # lowered embeddings: LayerNorm gets a bfloat16 input next to its float32 weight
    ("gpt2-fp32-wte-bf16", gpt2, "fp32", "transformer.w[tp]e", "bfloat16", "transformer.h.0",
     {"layer_norm": torch.float32}),
    # a lowered final norm: lm_head's F.linear gets a bfloat16 input next to its float32 weight
    ("llama-fp32-norm-bf16", llama, "fp32", "model.norm", "bfloat16", "lm_head", {"linear": torch.float32}),
    # the mirror: mixed_bf16 with v_proj raised to float32; SDPA gets bf16 q/k and a float32 v
    ("llama-mixed_bf16-v_proj-fp32", llama, "mixed_bf16", "model.layers.0.self_attn.v_proj", "float32",
     "model.layers.0.self_attn", {"scaled_dot_product_attention": torch.bfloat16}),
    ("gpt2-eager-mixed_bf16-c_attn-fp32", lambda: gpt2("eager"), "mixed_bf16", "transformer.h.0.attn.c_attn",
     "float32", "transformer.h.0.attn", {"matmul": torch.bfloat16, "softmax": torch.float32}),
    # two low dtypes: torch's promote kernel for cat asserted (at::autocast::prioritize)
    ("llama-mixed_bf16-q_proj-fp16", llama, "mixed_bf16", "model.layers.0.self_attn.q_proj", "float16",
     "model.layers.0.self_attn", {"cat": None, "scaled_dot_product_attention": torch.bfloat16}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ops_after_an_override_run_as_the_plan_decides(case):
    _, build, base, path, dtype, watched, want = case
    model = build()
    policy = unimp.load({"extends": base, "overrides": [{"modules": [path], "compute_dtype": dtype}]})
    amp = unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls, handles = watch(model.get_submodule(watched))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):  # real training steps: every forward's calls are checked
        calls.calls.clear()
        loss = amp.model(ids, labels=ids).loss
        seen = check_calls(amp.plan, calls.calls, set(want))
        for name, ran in want.items():
            if ran is not None:
                assert {d for n, d in seen if n == name} == {ran}, (name, seen)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0], losses  # it trains
    for h in handles:
        h.remove()
    amp.remove()


def test_float32_policy_with_a_bfloat16_v_proj_trains_as_plain_torch_by_hand():
    """The report's policy over three SGD steps equals plain torch with the casts written out: v_proj in
    bfloat16 (input and weight cast), its output cast to float32 where the attention (``lower`` = float32) takes
    it; every other op float32."""
    model = llama()
    by_hand = copy.deepcopy(model)
    v_proj = by_hand.model.layers[0].self_attn.v_proj
    v_proj.forward = lambda x: F.linear(x.bfloat16(), v_proj.weight.bfloat16()).float()
    policy = unimp.load({"extends": "fp32",
                         "overrides": [{"modules": ["model.layers.0.self_attn.v_proj"], "compute_dtype": "bfloat16"}]})
    amp = unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(by_hand.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    layers = sum(1 for m in by_hand.modules() if next(m.children(), None) is None)
    tol = reference_tolerance("float32", layers)  # both run the same float32 (and bfloat16 v_proj) arithmetic
    for _ in range(3):
        ours = amp.model(ids, labels=ids).loss
        ref = by_hand(ids, labels=ids).loss
        assert ours.dtype == ref.dtype == torch.float32
        assert abs(float(ours) - float(ref)) <= tol * abs(float(ref)), (float(ours), float(ref))
        amp.backward(ours)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        ref.backward()
        opt.step()
        opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        rel = float((p - q).norm() / q.norm())
        assert rel <= tol, (name, rel)
    amp.remove()


def test_float32_policy_with_a_bfloat16_v_proj_compiles_as_eager():
    """``torch.compile`` traces the same rules: one graph, no break, eager's loss."""
    torch._dynamo.reset()
    model = llama()
    policy = unimp.load({"extends": "fp32",
                         "overrides": [{"modules": ["model.layers.0.self_attn.v_proj"], "compute_dtype": "bfloat16"}]})
    amp = unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    explained = torch._dynamo.explain(amp.model)(ids, labels=ids)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    compiled = torch.compile(amp.model, backend="aot_eager")(ids, labels=ids).loss  # eager's kernels, traced
    eager = amp.model(ids, labels=ids).loss
    assert torch.equal(compiled, eager)
    compiled.backward()
    amp.remove()


class Mix(torch.nn.Module):
    """Ops torch's CPU autocast has no kernel for (the Plan notes that it keeps torch's own choice for them:
    they follow their inputs), on two activations."""

    def __init__(self) -> None:
        super().__init__()
        self.bilinear = torch.nn.Bilinear(16, 16, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        outs = (torch.mv(a, b[0]), torch.dot(a[0], b[1]).expand(8), torch.tensordot(a, b.T, 1)[:, 0],
                self.bilinear(a, b)[:, 0], torch.cross(a[:, :3], b[:, :3], dim=-1)[:, 0])
        return torch.stack([o.float() for o in outs]).sum(0)


class Planted(torch.nn.Module):
    """An override's layer (``planted``) next to a plain one, both into :class:`Mix`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.plain, self.planted, self.mix = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), Mix()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.plain(x), self.planted(x))


@pytest.mark.parametrize("base,dtype", [("fp32", "bfloat16"), ("mixed_bf16", "float32")])
def test_ops_torch_keeps_promote_mixed_inputs_instead_of_failing(base, dtype):
    """torch refuses these on mixed dtypes (``dot : expected both vectors to have same dtype``); an op that
    follows its inputs runs at the widest of them, as torch's own type promotion runs ``add``."""
    model = Planted()
    policy = unimp.load({"extends": base, "overrides": [{"modules": ["planted"], "compute_dtype": dtype}]})
    amp = unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls, handles = watch(model.mix)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        calls.calls.clear()
        loss = amp.model(x).square().mean()
        ran = set()
        for name, func, args, kwargs, out in calls.calls:
            if name in KEPT:
                assert set(_inputs(args, kwargs)) == {torch.float32, torch.bfloat16}, name  # mixed, as given
                with torch.autocast("cpu", enabled=False):
                    ref = func(*_cast(args, torch.float32), **_cast(kwargs, torch.float32))
                assert out.dtype == torch.float32, name
                rel = float((out - ref).norm() / ref.norm())
                assert rel <= reference_tolerance("float32", 1), (name, rel)
                ran.add(name)
        assert ran == KEPT, ran
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
    for h in handles:
        h.remove()
    amp.remove()


def test_in_place_ops_the_policy_moves_write_their_input_eager_and_compiled():
    """``h.exp_()`` (transcendental: float32) on a bfloat16 ``h`` computes in float32 and writes ``h``; it
    wrote a float32 copy and left ``h`` as it was under ``torch.compile`` (which always traces the rules)."""

    class InPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            h.exp_()
            return h

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for policy in ("mixed_bf16", {"extends": "fp32", "overrides": [{"modules": ["fc"], "compute_dtype": "bfloat16"}]}):
        torch._dynamo.reset()
        model = InPlace()
        fc = model.fc
        by_hand = F.linear(x.bfloat16(), fc.weight.bfloat16(), fc.bias.bfloat16()).float().exp().bfloat16()
        amp = unimp.apply(policy, model)
        with torch.no_grad():
            eager = amp.model(x)
            compiled = torch.compile(amp.model, backend="aot_eager")(x)
        # a float32 exp rounded once to bfloat16 (and the policy's output dtype)
        assert torch.equal(eager, by_hand.to(eager.dtype)) and torch.equal(compiled, eager), policy
        amp.remove()
