"""Hardware awareness, IPEX's modes, training through the documented loop, and remove() after training.

Hardware expectations come from unimp.hardware (`tox -e hwsim` reruns this file on a simulated
AVX2-only CPU, where IPEX's bf16 weight prepack is not available).
"""

import pytest
import torch

import unimp
from unimp import hardware
from unimp.conformance import cast_like
from unimp.dtypes import reference_tolerance
from unimp.hardware import LEVELS, CpuFacts
from unimp.loss_scale import LossScale
from unimp.spi import Plan
from unimp_ipex.engine import find_engine
from unimp_ipex.hardware import bf16_prepack
from unimp_ipex.plan import compile_plan

pytestmark = pytest.mark.hardware
NO_BF16 = CpuFacts("x86_64", "test CPU", frozenset(LEVELS["avx2"]))


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.LayerNorm(32),
                               torch.nn.Linear(32, 8))


def step(amp, x, poison=False):
    loss = amp.model(x).float().square().mean()
    amp.backward(loss * float("inf") if poison else loss)
    amp.optimizer.step()
    amp.optimizer.zero_grad()


def test_auto_is_float32_with_a_reason_on_a_cpu_without_bf16():
    plan = compile_plan(Plan.request(unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto"}), "ipex"), None,
                        find_engine("torch"), NO_BF16)
    assert plan.compute_dtype == "float32" and "no native bfloat16" in plan.compute_reason
    assert plan.details.autocast is None


def test_auto_follows_this_cpus_facts():
    model = mlp()
    amp = unimp.apply({"extends": "mixed_bf16", "compute_dtype": "auto"}, model,
                      torch.optim.SGD(model.parameters(), lr=0.1))
    facts = hardware.cpu()
    assert amp.plan.compute_dtype == ("bfloat16" if facts.native_bf16 else "float32")
    assert facts.describe() in amp.plan.compute_reason
    amp.remove()


def test_explicit_bf16_on_a_cpu_without_bf16_warns_it_is_slow():
    with pytest.warns(unimp.UnimpWarning, match="emulates bfloat16 and runs slower than float32") as caught:
        plan = compile_plan(Plan.request(unimp.load("mixed_bf16"), "ipex"), None, find_engine("torch"), NO_BF16)
    assert [w.filename for w in caught] == [__file__] and "emulated" in plan.compute_reason


def test_bf16_weights_are_prepacked_only_where_ipex_can_and_the_plan_says_so():
    plan = compile_plan(Plan.request(unimp.load("pure_bf16"), "ipex"), mlp(), find_engine("ipex"), NO_BF16)
    assert plan.details.ipex.dtype == "bfloat16" and plan.details.ipex.weights_prepack is False
    assert "AVX512 BW/VL/DQ or AVX-NE-CONVERT" in plan.details.ipex.reason


@pytest.mark.skipif(bf16_prepack(hardware.cpu()), reason="IPEX accepts bf16 weight prepack on this CPU")
def test_ipex_refusing_this_cpu_is_a_unimp_error_not_its_assertion():
    from unimp_ipex.optimizer import optimize

    model = mlp()
    with pytest.raises(unimp.UnsupportedError, match="refused this CPU.*engine='torch'"):
        optimize(model, torch.optim.SGD(model.parameters(), lr=0.1), {"dtype": torch.bfloat16, "weights_prepack": True})


@pytest.mark.skipif(hardware.cpu().native_fp16, reason="this CPU has float16 units")
def test_fp16_without_avx512_fp16_is_a_clear_error():
    with pytest.raises(unimp.UnsupportedError, match="compute_dtype = 'float16'.*use 'bfloat16' or 'auto'"):
        unimp.apply("mixed_fp16", mlp(), backend="ipex")


def test_pure_bf16_uses_ipex_masters_and_remove_writes_them_back():
    model = mlp()
    amp = unimp.apply("pure_bf16", model, torch.optim.Adam(model.parameters(), lr=1e-2))
    assert amp.plan.details.ipex.dtype == "bfloat16" and amp.model is not model
    assert amp.plan.details.ipex.weights_prepack is bf16_prepack(hardware.cpu())
    assert model[0].weight.dtype == torch.float32  # the user's module is not touched
    x = torch.randn(8, 16)
    for _ in range(3):
        step(amp, x)
    pairs = amp.master_weights
    assert {n for n, _, _ in pairs} == {"0.weight", "0.bias", "3.weight", "3.bias"}
    for _, low, master in pairs:  # round-to-nearest bf16 of the fp32 master (not IPEX's split truncation)
        assert torch.equal(low.float(), torch.from_numpy(cast_like(master.detach().numpy(), "bfloat16")))
    bias_master = dict((n, m) for n, _, m in pairs)["0.bias"].detach().clone()
    assert amp.model[2].weight.dtype == torch.float32  # LayerNorm params stay fp32 (float32 list)
    assert amp.remove() is model
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].bias, bias_master)
    assert not torch.equal(model[0].bias, model[0].bias.bfloat16().float())  # fp32 masters, not bf16 copies


def test_dynamic_loss_scaling_runs_on_unimp_masters_and_matches_the_reference():
    policy = unimp.load({"extends": "pure_bf16", "loss_scale": {"mode": "dynamic", "skip_nonfinite": True,
                                                                "initial": 1024.0, "growth_interval": 2}})
    model = mlp()
    amp = unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert amp.plan.details.ipex.dtype == "float32"
    assert "cannot be unscaled or skipped" in amp.plan.details.ipex.reason
    pattern = [False, False, True, False, True, True, False]
    rule, state = LossScale(policy.loss_scale), LossScale(policy.loss_scale).initial_state()
    x = torch.randn(8, 16)
    for poison in pattern:
        before = [p.detach().clone() for p in amp.model.parameters()]
        step(amp, x, poison)
        out = rule.update(state, not poison)
        state = out.state
        assert (amp.scale, amp.skipped_steps) == (state.scale, state.skipped)
        if out.skipped:
            assert all(torch.equal(a, b) for a, b in zip(before, amp.model.parameters()))
    amp.remove()


def test_clip_and_accumulate_under_ipex_masters():
    model = mlp()
    amp = unimp.apply("pure_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(8, 16)
    for _ in range(2):  # accumulate
        amp.backward(amp.model(x).float().square().mean() * 100)
    norm = amp.clip_grad_norm_(0.5)
    grads = [p.grad for p in amp.model.parameters() if p.grad is not None]
    assert norm > 0.5 and torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])) <= 0.5 + 1e-2
    amp.optimizer.step()
    amp.remove()


def test_cnn_fp32_prepack_and_mixed_bf16_without_prepack():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    x = torch.randn(2, 3, 8, 8)
    for preset, prepack in (("fp32", True), ("mixed_bf16", False)):
        amp = unimp.apply(preset, net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert amp.plan.details.ipex.weights_prepack is prepack
        step(amp, x)  # fp32-prepacked conv under bf16 autocast would abort here (see README)
        assert amp.remove() is net and net[0].weight.is_contiguous()


def test_cuda_or_meta_models_are_not_taken():
    from unimp_ipex.backend import IpexBackend

    meta = torch.nn.Linear(2, 2, device="meta")
    assert not IpexBackend().accepts(meta) and not IpexBackend().accepts(object())


def test_inference_in_eval_mode_through_ipex_graph_module():
    # importing IPEX registers its own CPU kernels process-wide (its AutocastCPU and oneDNN ops); `before`
    # must run with them loaded, as `after remove()` does: under a simulated AVX2 CPU they differ from
    # torch's own in the last bit (1.8e-7), whatever unimp restores
    import intel_extension_for_pytorch  # noqa: F401

    model = mlp().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # IPEX's documented inference: ipex.optimize + autocast
            # the output is the last Linear's, bf16, not cast (pure_bf16's output_dtype "unchanged"); the Linear alone,
            # as IPEX's bf16 LayerNorm has no oneDNN primitive on an AVX2-only CPU (or under its simulation)
            native = model[-1](torch.randn(4, model[-1].in_features)).dtype
    amp = unimp.apply("pure_bf16", model)
    assert type(amp.model).__name__ == "GraphModule"  # what ipex.optimize returns for a Sequential
    with torch.no_grad():
        out = amp.model(x)
    # bf16 weights, compute and output against float32: within bf16's rounding of a 4-layer forward
    rel = float((out.float() - before).norm() / before.norm())
    assert out.dtype == native == torch.bfloat16 and rel <= reference_tolerance("bfloat16", len(model)), rel
    report = amp.report()
    assert report.row("0").kind == "linear" and report.row("0").param_dtype == "bfloat16"
    assert amp.remove() is model
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_training_mode_without_optimizer_is_a_clear_error():
    with pytest.raises(unimp.UnsupportedError, match="optimizer: .*model.eval\\(\\)"):
        unimp.apply("mixed_bf16", mlp(), backend="ipex")
