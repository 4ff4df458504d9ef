"""``amp.watch()`` on Paddle dygraph, real training steps of a small GPT written with paddle.nn (CPU).

Expected values come from the framework: the statistics are recomputed with NumPy from the very tensors the
step produced (captured by the test's own Paddle hooks; float16 classes by NumPy's float16 cast), and where
a planted overflow appears is checked on those tensors too. On CPU Paddle runs ``mixed_fp16`` in float32 (the
Plan's reported fallback: no float16 CPU kernels), so a planted overflow passes float32's max too (it is
past float16's by far), and the layers' statistics are measured in their compute dtype (float16 for Linear).
"""

import json

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from paddle import nn

import unimp
from unimp.errors import UnsupportedError
from unimp.watch import read_records

FP16 = {"extends": "mixed_fp16", "on_unsupported": "fallback"}  # what Paddle runs on CPU: float32 kernels


class Attention(nn.Layer):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape([b, t, 3, self.heads, d // self.heads]).transpose([2, 0, 3, 1, 4]).unbind(0)
        att = q.matmul(k, transpose_y=True) / (d // self.heads) ** 0.5
        att = att + paddle.triu(paddle.full([t, t], float("-inf")), 1)  # causal
        y = F.softmax(att, -1).matmul(v)
        return self.proj(y.transpose([0, 2, 1, 3]).reshape([b, t, d]))


class MLP(nn.Layer):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Layer):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d), MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Layer):
    """Token and position embeddings, 2 pre-LN blocks (attention, MLP), final LayerNorm, LM head; returns the loss."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.LayerList([Block(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.wte(ids) + self.wpe(paddle.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).astype("float32")
        return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1]))


def gpt_amp(policy=FP16, seed=0):
    paddle.seed(seed)
    model = GPT()
    amp = unimp.apply(policy, model, paddle.optimizer.AdamW(1e-3, parameters=model.parameters()))
    ids = paddle.to_tensor(np.random.default_rng(seed).integers(0, 64, (4, 16)), dtype="int64")
    return model, amp, ids


def train_step(amp, ids):
    amp.backward(amp.model(ids, ids))
    skipped = amp.optimizer.step()
    amp.optimizer.clear_grad()
    return skipped


def hooks_on(model):
    """How many forward hooks the model's sublayers hold (Paddle's own registries)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_post_hooks) for _, m in model.named_sublayers())


def scale(param, factor):
    with paddle.no_grad():
        param.set_value(param * factor)


def overflow(param):
    """Every weight at +-3e38: the layer's outputs pass float16's max by far (and float32's: on CPU it runs float32)."""
    with paddle.no_grad():
        param.set_value(paddle.sign(param) * 3e38)


# ---------------------------------------------------------------- sampling; unwatched steps run no hook
def test_sampled_steps_and_no_hook_on_unwatched_steps(tmp_path):
    model, amp, ids = gpt_amp()
    path = tmp_path / "numerics.jsonl"
    watch = amp.watch(every=3, path=str(path))
    during = []  # hooks on the sublayers while each step's forward runs (the test's hook on the model itself)
    mine = model.register_forward_pre_hook(lambda layer, args: during.append(hooks_on(model)))
    for _ in range(7):
        assert not train_step(amp, ids)
    mine.remove()
    assert [r["step"] for r in watch.records] == [0, 3, 6]
    assert all(r["sampled"] and not r["skipped"] for r in watch.records)
    n = 2 * len(list(model.named_sublayers()))  # a pre- and a post-hook per sublayer, on sampled steps only
    assert during == [n, 0, 0, n, 0, 0, n]
    assert hooks_on(model) == 0  # step 7 is not sampled: nothing installed for it
    assert read_records(path) == watch.records
    assert len(path.read_text().splitlines()) == 3 and json.loads(path.read_text().splitlines()[0])["step"] == 0
    numerics = amp.report().numerics
    assert numerics["sampled_steps"] == 3 and {r["path"] for r in numerics["layers"]} >= {"head", "blocks.1.mlp.fc2"}
    watch.close()
    assert hooks_on(model) == 0 and not any(amp.iteration.listeners)
    amp.remove()


def test_a_watch_starting_mid_run_samples_from_its_first_step():
    _, amp, ids = gpt_amp()
    for _ in range(2):
        train_step(amp, ids)
    watch = amp.watch(every=2)
    for _ in range(3):
        train_step(amp, ids)
    assert [r["step"] for r in watch.records] == [2, 4]
    amp.remove()


# ---------------------------------------------------------------- record contents against NumPy
def _expected(arr, dtype):
    """amax and fractions of ``arr`` (float32) in ``dtype``, from NumPy: the float16 classes by its float16 cast."""
    a = np.abs(arr.astype(np.float32))
    n, finite = a.size, np.isfinite(a)
    with np.errstate(over="ignore"):
        low = a.astype(np.float16) if dtype == "float16" else a
    tiny = np.finfo(low.dtype).tiny
    return {"amax": float(a[finite].max()) if finite.any() else 0.0,
            "nonfinite": int((~finite).sum()) / n,
            "overflow": int(np.isinf(low).sum()) / n,
            "underflow": int(((a != 0) & (low == 0)).sum()) / n,
            "subnormal": int(((low != 0) & (low < tiny)).sum()) / n,
            "zero": int((a == 0).sum()) / n}


def test_record_contents_match_numpy_on_the_same_tensors():
    model, amp, ids = gpt_amp()
    scale(model.blocks[0].mlp.fc1.weight, 3e4)  # planted: outputs past float16's max (finite in float32)
    scale(model.head.weight, 1e-6)  # planted: outputs in float16's subnormal range and below it
    captured, handles = {}, []
    for path, layer in model.named_sublayers():
        def post(layer, args, out, path=path):
            captured[path, "output"] = out.numpy().copy()
            if not out.stop_gradient:
                out.register_hook(lambda g: captured.__setitem__((path, "grad_output"), g.numpy().copy()))
        handles.append(layer.register_forward_post_hook(post))
    watch = amp.watch(every=100)
    assert not train_step(amp, ids)
    for h in handles:
        h.remove()
    (record,) = watch.records
    rows = {(s["path"], s["tensor"]): s for s in record["layers"]}
    assert set(rows) == set(captured)  # every layer that ran: its output and the gradient arriving there
    for key, s in rows.items():
        want = _expected(captured[key], s["dtype"])
        assert {k: s[k] for k in want} == want, key
    linear = [p for p, m in model.named_sublayers() if isinstance(m, nn.Linear)]
    assert {rows[p, "output"]["dtype"] for p in linear} == {"float16"}  # the policy's compute dtype for Linear
    assert rows["blocks.0.mlp.fc1", "output"]["overflow"] > 0
    assert rows["head", "output"]["underflow"] > 0 and rows["head", "output"]["subnormal"] > 0
    # gradients as the backward holds them: scaled by the step's loss scale
    assert record["scale"] == amp.policy.loss_scale.initial
    forward = [s["path"] for s in record["layers"] if s["direction"] == "forward"]
    assert forward.index("blocks.0.mlp.fc1") < forward.index("blocks.0.mlp") < forward.index("blocks.0")
    amp.remove()


# ---------------------------------------------------------------- where a skipped step's first non-finite value was
def _first_nonfinite_output(model, amp, ids):
    """The test's own view of a step: the layers' outputs in the order they return, and whether each is finite."""
    order, handles = [], []
    for path, layer in model.named_sublayers():
        handles.append(layer.register_forward_post_hook(
            lambda layer, args, out, path=path: order.append((path, bool(paddle.isfinite(out).all())))))
    skipped = train_step(amp, ids)
    for h in handles:
        h.remove()
    return skipped, next(p for p, ok in order if not ok)


@pytest.mark.parametrize("every,localize", [(100, True), (3, False)])
def test_planted_forward_overflow_names_the_layer(every, localize):
    model, amp, ids = gpt_amp()
    watch = amp.watch(every=every, localize=localize)
    for _ in range(3):
        assert not train_step(amp, ids)
    overflow(model.blocks[1].mlp.fc1.weight)  # planted at step 3
    skipped, first = _first_nonfinite_output(model, amp, ids)
    assert skipped and first == "blocks.1.mlp.fc1"
    assert amp.skipped_steps == 1
    record = watch.skipped[0]
    assert record["step"] == 3 and record["sampled"] == (every == 3)
    assert record["first_nonfinite"] == {"path": "blocks.1.mlp.fc1", "direction": "forward", "tensor": "output",
                                         "exact": True}
    assert "forward: the output of blocks.1.mlp.fc1" in str(amp.report())
    amp.remove()


@pytest.mark.parametrize("every,localize,where", [(100, True, ("blocks.0.mlp.fc2", "grad_input")),
                                                  (3, False, ("blocks.0.mlp.act", "grad_output"))])
def test_planted_backward_overflow_names_backward(every, localize, where):
    model, amp, ids = gpt_amp()
    watch = amp.watch(every=every, localize=localize)
    for _ in range(3):
        assert not train_step(amp, ids)
    mlp = model.blocks[0].mlp
    scale(mlp.fc1.weight, 1e-36)  # step 3: tiny activations into fc2, huge weights in it: a finite forward whose
    scale(mlp.fc1.bias, 0.0)  # backward overflows (the gradient fc2 produces for its input)
    scale(mlp.fc2.weight, 1e37)
    seen = {}

    def post(layer, args, out, name):
        seen[name + ".out"] = bool(paddle.isfinite(out).all())
        out.register_hook(lambda g: seen.__setitem__(name + ".grad", bool(paddle.isfinite(g).all())))

    hooks = [layer.register_forward_post_hook(lambda layer, args, out, name=name: post(layer, args, out, name))
             for name, layer in (("fc2", mlp.fc2), ("act", mlp.act))]
    assert train_step(amp, ids)
    for h in hooks:
        h.remove()
    # Paddle's own tensors: the forward was finite, the gradient arriving at fc2 too, the one it produced not
    assert seen == {"act.out": True, "fc2.out": True, "fc2.grad": True, "act.grad": False}
    record = watch.skipped[0]
    assert record["step"] == 3
    assert record["first_nonfinite"] == {"path": where[0], "direction": "backward", "tensor": where[1],
                                         "exact": True}
    amp.remove()


def test_unsampled_skip_without_localize_is_located_from_what_the_step_left():
    model, amp, ids = gpt_amp()
    watch = amp.watch(every=100)
    train_step(amp, ids)
    overflow(model.blocks[1].mlp.fc1.weight)
    loss = amp.model(ids, ids)
    amp.backward(loss)
    assert amp.optimizer.step()
    # no hook ran on step 1; Paddle's LayerNorm turns the infinite rows into finite ones (the loss is finite), so
    # the backward's parameter gradients are what is left: the head's, the first in gradient-arrival order
    assert bool(paddle.isfinite(loss)) and not bool(paddle.isfinite(model.head.weight.grad).all())
    amp.optimizer.clear_grad()
    assert watch.skipped[0]["first_nonfinite"] == {"path": "head", "direction": "backward", "tensor": "grad_param",
                                                   "exact": False}
    amp.remove()


# ---------------------------------------------------------------- undo, refusals
def test_unwatch_and_remove_leave_no_hook():
    model, amp, ids = gpt_amp()
    before = hooks_on(model)
    watch = amp.watch(every=1, localize=True)
    train_step(amp, ids)
    assert hooks_on(model) > before
    assert amp.unwatch() is watch and watch.closed
    assert hooks_on(model) == before and not any(amp.iteration.listeners) and amp._watching is None
    train_step(amp, ids)
    assert len(watch.records) == 1  # closed: nothing more recorded
    amp.watch(every=1, localize=True)
    train_step(amp, ids)
    assert hooks_on(model) > before
    assert amp.remove() is model
    assert hooks_on(model) == before


def test_a_second_watch_and_a_watch_without_optimizer_are_refused():
    _, amp, _ = gpt_amp()
    amp.watch(every=10)
    with pytest.raises(UnsupportedError, match="already running"):
        amp.watch(every=10)
    amp.remove()
    bare = unimp.apply(FP16, GPT())
    with pytest.raises(UnsupportedError, match="amp.optimizer.step"):
        bare.watch()
    bare.remove()


def test_tensorboard_without_visualdl_names_the_install():
    try:
        import visualdl  # noqa: F401
        pytest.skip("visualdl is installed: the writer exists")
    except ImportError:
        pass
    model, amp, _ = gpt_amp()
    with pytest.raises(UnsupportedError, match="pip install visualdl"):
        amp.watch(tensorboard="runs/x")
    assert hooks_on(model) == 0 and not any(amp.iteration.listeners)
    amp.watch(every=1)  # nothing was left running
    amp.remove()


def test_static_program_refuses_saying_why():
    paddle.enable_static()
    try:
        main, start = paddle.static.Program(), paddle.static.Program()
        with paddle.static.program_guard(main, start):
            x = paddle.static.data("x", [8, 16], "float32")
            loss = paddle.mean(paddle.static.nn.fc(x, 8))
        amp = unimp.apply({"extends": "mixed_bf16", "on_unsupported": "fallback"}, main)
        with pytest.raises(UnsupportedError, match="static Program runs whole in the executor"):
            amp.watch(every=10)
        with pytest.raises(UnsupportedError, match="static Program"):
            amp.watch(tensorboard="runs/x")
        amp.remove()
        assert loss is not None
    finally:
        paddle.disable_static()
