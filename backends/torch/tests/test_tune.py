"""unimp.tune on torch (CPU: torchao's FP8 emulated): a planted FP8-sensitive layer is found and kept in bf16, and
300 training steps of bf16, all-FP8 and the tuned policy show why (examples/fp8_tune.py, the README's example);
the torch measurements (recorded outputs, GEMM shapes, the FP8 microbenchmark off GPU, Hutchinson traces)."""

from __future__ import annotations

import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

import unimp
from unimp.backend.applied import is_applied
from unimp.cli import main
from unimp.dtypes import FP8_FORMATS, reference_tolerance
from unimp.errors import TuneError

pytest.importorskip("torchao", reason="FP8 needs torchao: pip install 'unimp-torch[fp8]'")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import fp8_tune

E4M3 = torch.float8_e4m3fn
PLANTED = "embed"  # the layer that sees the sink row raw (fp8_tune.Net)


def test_the_plant_is_what_tensorwise_fp8_cannot_hold():
    """Independently of unimp: one e4m3 scale for embed's input (set by the sink row) flushes every other row to 0,
    while after the norm every row is at unit scale."""
    x, _ = fp8_tune.batches(1, seed=0)[0]
    scale = torch.finfo(E4M3).max / x.abs().max()
    assert ((x * scale).to(E4M3).float()[1:] == 0).all() and (x[1:].to(torch.bfloat16) != 0).any()
    model = fp8_tune.model()
    h = model.norm(model.embed(x))
    assert h.abs().max() < 20  # the later layers' inputs: a range e4m3 holds


def test_tuned_fp8_policy_keeps_the_planted_layer_and_trains_as_bf16_does():
    """The issue's acceptance: all-FP8 ends >= 5% worse than bf16 after 300 steps; the tuned policy keeps the planted
    layer out of FP8 and ends within 1% of bf16 (the mean loss of the last 50 steps, a fresh batch each step)."""
    start = time.perf_counter()
    tuned = unimp.tune("fp8_tensorwise", *fp8_tune.factory())
    tuning = time.perf_counter() - start
    assert [k.layer.path for k in tuned.kept] == [PLANTED]
    assert {r.path for r in tuned.lowered} == {"up", "down", "head"}
    losses, seconds = {}, {}
    for name, policy in (("bf16", "mixed_bf16"), ("fp8", "fp8_tensorwise"), ("tuned", tuned.policy)):
        start = time.perf_counter()
        losses[name] = fp8_tune.train(policy, 300)
        seconds[name] = time.perf_counter() - start
    print(f"\ntune {tuning:.1f}s; 300 steps: " + ", ".join(f"{k} {losses[k]:.4f} ({seconds[k]:.1f}s)" for k in losses))
    assert losses["fp8"] >= 1.05 * losses["bf16"]
    assert losses["tuned"] <= 1.01 * losses["bf16"]
    model = fp8_tune.model()
    amp = unimp.apply(tuned.policy, model, torch.optim.AdamW(model.parameters()))
    report = amp.report(fp8_tune.batches(1, seed=0)[0][0])
    assert {r.path: r.fp8 for r in report.rows if r.kind == "linear"} == {
        "embed": None, "up": "tensorwise", "down": "tensorwise", "head": "tensorwise"}
    amp.remove()


def test_sensitivity_sees_the_range_loss_in_the_outputs():
    """At initialisation the planted layer barely moves the loss, but its outputs move by far more than rounding to
    e4m3 explains (u * sqrt(3): its two operands and output); the others stay within it. No FP8 GEMMs on a CPU:
    speed-ups are not measured, so they decide nothing."""
    model, batches, loss_fn = fp8_tune.factory()
    table = unimp.sensitivity("fp8_tensorwise", model, batches, loss_fn)
    bound = reference_tolerance("e4m3", 3)
    assert table.rounding == bound and table.format == "e4m3" and table.high == "bfloat16"
    assert table.rows[0].path == PLANTED and table.rows[0].output_divergence > bound
    assert all(r.output_divergence < bound for r in table.rows[1:])
    device = next(model.parameters()).device.type
    assert device == "cpu" and table.speed_note == f"not measured (no FP8 GEMMs on this device: {device})"
    assert all(r.speedup is None and r.lowered_to == "fp8 tensorwise" for r in table.rows)
    rows = batches[0][0].shape[0]  # every row goes through the model, the sink row too
    assert {r.path: r.shape for r in table.rows} == {  # (M, K, N) from the batch and the layers' features
        "embed": (rows, fp8_tune.FEATURES, fp8_tune.HIDDEN), "up": (rows, fp8_tune.HIDDEN, fp8_tune.HIDDEN),
        "down": (rows, fp8_tune.HIDDEN, fp8_tune.HIDDEN), "head": (rows, fp8_tune.HIDDEN, fp8_tune.OUTPUTS)}
    assert "not measured (no FP8 GEMMs on this device: cpu)" in str(table)


def test_cli_tunes_the_example_script(tmp_path, capsys):
    out = tmp_path / "tuned.toml"
    script = Path(fp8_tune.__file__)
    assert main(["tune", f"{script}:factory", "--policy", "fp8_tensorwise", "-o", str(out)]) == 0
    text = out.read_text()
    policy = unimp.load(tomllib.loads(text))
    assert [(o.modules, o.fp8) for o in policy.overrides] == [((PLANTED,), False)]
    comment = next(line for line in text.splitlines() if line.startswith(f"# {PLANTED}:"))
    assert "output divergence" in comment and "FP8 GEMM speed-up not measured" in comment
    assert "most sensitive first" in capsys.readouterr().out


class TwoHeads(nn.Module):
    """Two independent bias-free linear layers on their own inputs: the Hessian is block-diagonal between them."""

    def __init__(self, k: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(k, 4, bias=False), nn.Linear(k, 4, bias=False)


def test_hutchinson_trace_is_exact_for_a_diagonal_hessian():
    """loss = mean((W x_r)^2) over rows r and 4 outputs, rows x_r = c e_r: the Hessian in W is diagonal, with trace
    2 / rows * sum_r |x_r|^2 = 2 c^2 (4 outputs x k rows / (rows x 4 outputs)); a Rademacher v gives it exactly."""
    k, ca, cb = 8, 3.0, 0.5
    model = TwoHeads(k)
    eye = torch.eye(k)

    def loss_fn(m, batch):
        return m.a(batch * ca).square().mean() + m.b(batch * cb).square().mean()

    hooks = unimp.get_backend("torch").tuning()
    traces = hooks.hessian_traces(model, loss_fn, [eye, eye], ["a", "b"], 3, seed=0)
    assert traces["a"] == (pytest.approx(2 * ca**2, rel=1e-5), 4 * k)
    assert traces["b"] == (pytest.approx(2 * cb**2, rel=1e-5), 4 * k)
    with pytest.raises(TypeError, match="loss_fn to return the loss tensor with its graph"):
        hooks.hessian_traces(model, lambda m, x: loss_fn(m, x).item(), [eye], ["a"], 1, seed=0)


def test_hutchinson_through_sensitivity():
    model, batches, loss_fn = fp8_tune.factory()
    table = unimp.sensitivity("fp8_tensorwise", model, batches[:1], loss_fn, hessian_samples=2, layers=["head"])
    row = table.row("head")
    assert row.params == fp8_tune.HIDDEN * fp8_tune.OUTPUTS + fp8_tune.OUTPUTS and row.hessian_trace > 0
    assert "hessian trace" in str(table)


def test_bf16_sensitivity_of_a_tiny_llama_measures_every_linear():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    table = unimp.sensitivity("mixed_bf16", model, ids, lambda m, x: m(input_ids=x, labels=x).loss)
    linears = {p for p, m in model.named_modules() if isinstance(m, nn.Linear)}  # what mixed_bf16 lowers as layers
    assert {r.path for r in table.rows} == linears and len(linears) == 2 * 7 + 1
    assert table.target == "bfloat16" and table.high == "float32" and table.noise == 0
    assert all(r.output_divergence is not None for r in table.rows)


def test_gemm_shapes_and_the_microbenchmark_off_gpu():
    hooks = unimp.get_backend("torch").tuning()
    model = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 48))
    x = torch.randn(3, 5, 32)
    shapes = hooks.gemm_shapes(model, ["0", "2", "1"], lambda: model(x))
    assert shapes == {"0": (15, 32, 16), "2": (15, 16, 48)}  # rows = 3 x 5; the ReLU has no GEMM
    assert not model._forward_pre_hooks and not model[0]._forward_pre_hooks  # hooks removed
    for recipe in ("tensorwise", "rowwise", "rowwise_gw_hp"):
        assert hooks.fp8_gemm_times(model, shapes.values(), recipe, "bfloat16", "e4m3") == \
            "not measured (no FP8 GEMMs on this device: cpu)"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_gw_hp"])
def test_the_microbenchmarks_fp8_step_computes_the_three_gemms(recipe):
    """What the GPU times is the right work: forward, grad-input and grad-weight through torch._scaled_mm with the
    recipe's scales and layouts (run here on CPU, untimed) match float32 within what rounding explains: u * sqrt(3)
    of e4m3 forward, of the gradient format backward, and of bfloat16 for rowwise_gw_hp's grad-weight."""
    from unimp_torch import tuning

    grad = "e5m2" if recipe == "tensorwise" else "e4m3"
    g8 = getattr(torch, FP8_FORMATS[grad])
    gen = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*s, generator=gen).to(torch.bfloat16) for s in ((64, 32), (48, 32), (64, 48)))
    try:
        got = tuning._fp8_step(recipe, torch.bfloat16, g8)(x, w, g)
    except (NotImplementedError, RuntimeError) as e:
        pytest.skip(f"torch {torch.__version__} has no CPU torch._scaled_mm ({e})")
    exact = tuning._high_step(x.double(), w.double(), g.double())
    errors = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, exact, strict=True)]
    bounds = [reference_tolerance("e4m3", 3), reference_tolerance(grad, 3),
              reference_tolerance("bfloat16" if recipe == "rowwise_gw_hp" else grad, 3)]
    assert all(e <= b for e, b in zip(errors, bounds, strict=True)), (errors, bounds)
    assert [a.shape for a in got] == [(64, 48), (64, 32), (48, 32)] and all(a.dtype == torch.bfloat16 for a in got)


# ---------------------------------------------------------------- speed decided by whole steps (issue 31)


def _llama(layers: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                        max_position_embeddings=16, use_cache=False))


def _lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(input_ids=batch[:, :-1]).logits.flatten(0, 1).float(),
                                       batch[:, 1:].flatten())


def test_step_seconds_times_a_cut_copy_and_leaves_the_model_alone():
    """The step timer runs the user's loss_fn forward and backward on a copy whose block stack is cut to two blocks;
    the user's model keeps its four blocks, its weights and no gradients."""
    from unimp_torch.tuning import STEP_BLOCKS, TorchTuning, _cut_stack

    model = _llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    seconds = TorchTuning().step_seconds(model, "fp8_tensorwise", _lm_loss, batch, compiled=False)
    assert seconds > 0 and len(model.model.layers) == 4 and not is_applied(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    cut = _llama()
    _cut_stack(cut, STEP_BLOCKS)
    assert len(cut.model.layers) == STEP_BLOCKS


def test_torchao_filters_are_candidate_sets():
    """torchao's own filters (its default and ``_auto_filter_for_recipe``) are what the search must beat."""
    from torchao.float8 import _auto_filter_for_recipe

    from unimp_torch.tuning import TorchTuning

    model = _llama(2)
    paths = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    sets = TorchTuning().fp8_candidate_sets(model, paths, "tensorwise")
    auto = _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head", "output"])
    assert sets["torchao default filter"] == [p for p in paths if p != "lm_head"]
    assert sets["torchao auto filter"] == [p for p in paths if auto(model.get_submodule(p), p)]


def test_no_fp8_gemms_means_no_speed_decision_and_no_device_claim():
    """On a CPU (FP8 emulated) the compiled-step search measures nothing: the file says so and claims no device."""
    batch = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    tuned = unimp.tune("fp8_tensorwise", _llama(2), [batch], _lm_loss, speed="compiled", max_layers=64)
    assert tuned.policy.tuned_on is None and "not measured (no FP8 GEMMs on this device: cpu)" in tuned.text
    with pytest.raises(TuneError, match="speed=a string 'fast'"):
        unimp.tune("fp8_tensorwise", _llama(2), [batch], _lm_loss, speed="fast")


def test_a_policy_tuned_on_another_device_warns_when_applied():
    model = _llama(2)
    with pytest.warns(unimp.UnimpWarning, match="tuned_on = 'NVIDIA H100 80GB HBM3', but the model is on 'cpu'"):
        unimp.apply(unimp.load("fp8_tensorwise").replace(tuned_on="NVIDIA H100 80GB HBM3"), model).remove()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unimp.apply(unimp.load("fp8_tensorwise").replace(tuned_on="cpu"), model).remove()
