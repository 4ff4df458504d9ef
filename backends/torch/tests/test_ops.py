"""Op lists really take effect per device; native-equal policies are plain torch.autocast."""

import copy
import gc
import pickle

import pytest
import torch
from models import Block

import unimp
from unimp.spi import Plan
from unimp_torch.op_overrides import PolicyMode
from unimp_torch.plan import TorchDetails, compile_plan

BF16, F32 = torch.bfloat16, torch.float32


def run(policy, model=None):
    model = model or Block()
    amp = unimp.apply(policy, model)
    amp.model(torch.randn(2, 4, 16))
    return amp, model.seen


def test_mixed_bf16_on_cpu_gives_the_cuda_dtypes():
    # plain CPU autocast leaves softmax/exp/sum/log_softmax in bf16 (the gap unimp closes) ...
    block = Block()
    with torch.autocast("cpu", dtype=BF16):
        block(torch.randn(2, 4, 16))
    assert block.seen["softmax"] == BF16 and block.seen["exp"] == BF16
    # ... mixed_bf16 runs them in float32, as CUDA autocast does, matmul stays bf16
    amp, seen = run("mixed_bf16")
    policy = amp.policy
    for op, canonical in {"softmax": "softmax", "exp": "transcendental", "sum": "reduction",
                          "log_softmax": "log_softmax"}.items():
        assert policy.decide("x", canonical).compute_dtype == "float32"  # expected: from the core
        assert seen[op] == F32, op
    assert seen["matmul"] == BF16
    assert amp.report().row("norm").compute_dtype == "float32"
    amp.remove()


def test_torch_autocast_cpu_preset_is_plain_autocast():
    plan = compile_plan(Plan.request(unimp.load("torch_autocast_cpu"), "torch"), device="cpu")
    assert plan.details.op_moves == {}
    amp, seen = run("torch_autocast_cpu")
    assert amp.wrapped == [] and amp.model.forward.ops is None  # no PolicyMode: plain autocast
    assert seen["softmax"] == BF16 and seen["matmul"] == BF16  # torch's native CPU behaviour
    amp.remove()


def cuda_rms_norm_move() -> dict:
    """torch < 2.13 registers no CUDA autocast kernel for rms_norm: unimp must add one (the only move)."""
    from unimp_torch.autocast import has_kernel

    return {} if has_kernel("rms_norm", "cuda") else {"rms_norm": "float32"}


@pytest.mark.parametrize("preset", ["mixed_bf16", "mixed_fp16", "pure_bf16", "fp16_master"])
def test_mixed_presets_on_cuda_are_autocast_plus_float32_means(preset):
    # planned here from the CUDA kernels registered in this torch build (no GPU needed): torch's
    # CUDA autocast runs sum in float32 but mean in its input dtype; these presets list
    # reduction (means included) as float32, as Keras and Flax run them
    plan = compile_plan(Plan.request(unimp.load(preset), "torch"), device="cuda")
    assert unimp.load(preset).ops.category("reduction") == "float32"  # expected: from the core
    assert plan.details == TorchDetails("cuda", plan.compute_dtype, {**cuda_rms_norm_move(), "mean": "float32"},
                                        "autocast_kernels")


def test_torch_autocast_cuda_keeps_torchs_mean_and_says_so():
    plan = compile_plan(Plan.request(unimp.load("torch_autocast_cuda"), "torch"), device="cuda")
    assert "mean" not in plan.details.op_moves
    note = next(n for n in plan.notes if n.startswith("reduction:"))
    assert "mean (inputs on cuda)" in note and "plain torch.autocast" in note
    assert note in str(plan)  # what `unimp explain` prints


def test_moved_ops_both_directions():
    custom = {"extends": "mixed_bf16", "ops": {"lower": ["softmax", "conv"], "float32": ["matmul", "linear"]}}
    amp, seen = run(custom)
    assert seen["softmax"] == BF16  # torch CPU autocast has no softmax kernel: unimp lowers it
    assert seen["matmul"] == F32  # torch CPU autocast lowers matmul in C++: unimp keeps it float32
    assert amp.report().row("qkv").compute_dtype == "float32"
    assert amp.plan.op("linear").control == "op" and amp.wrapped == []  # op level, no layer wrappers
    # torch's CPU autocast has a C++ kernel for matmul: the eager forward runs PolicyMode
    assert amp.plan.details.eager_mechanism == "function_mode"
    amp.remove()


class ModeSpy(Block):
    """A Block that records the torch function modes active while its forward runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes = list(torch.overrides._get_current_function_mode_stack())
        return super().forward(x)


def _autocast_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCPU")


def test_presets_move_ops_through_autocast_kernels_not_a_function_mode():
    # CPU autocast has no C++ kernel for softmax/exp/sum/log_softmax: unimp's Autocast kernels move
    # them, and nothing else in the forward pays for it (no TorchFunctionMode runs)
    gc.collect()  # copies left by other tests hold their kernels until collected
    assert not _autocast_kernel("aten::softmax.int")  # torch's own CPU list
    model = ModeSpy()
    amp = unimp.apply("mixed_bf16", model)
    assert amp.plan.details.eager_mechanism == "autocast_kernels"
    x = torch.randn(2, 4, 16)
    amp.model(x)  # the first forward is observed (the report's recorder mode runs then)
    model.seen.clear()
    amp.model(x)
    assert model.modes == []
    for op, canonical in {"softmax": "softmax", "exp": "transcendental", "sum": "reduction",
                          "log_softmax": "log_softmax"}.items():
        assert amp.policy.decide("x", canonical).compute_dtype == "float32"  # expected: from the core
        assert model.seen[op] == F32, op
    assert model.seen["matmul"] == BF16
    # a copy holds the kernels itself: it keeps the policy after the original's remove
    ema, data = copy.deepcopy(model), pickle.dumps(model)
    amp.remove()
    ema(x)
    assert ema.seen["softmax"] == F32 and ema.modes == []
    del ema
    gc.collect()
    assert not _autocast_kernel("aten::softmax.int")  # the last holder gone: torch's own behaviour
    loaded = pickle.loads(data)  # as in a fresh process: unpickling registers them again
    loaded(x)
    assert loaded.seen["softmax"] == F32 and loaded.modes == []
    del loaded
    gc.collect()
    with torch.autocast("cpu", dtype=BF16):
        assert torch.randn(3, dtype=BF16).softmax(-1).dtype == BF16


def test_custom_list_moving_an_op_with_a_cpp_kernel_runs_the_function_mode():
    model = ModeSpy()
    amp = unimp.apply({"extends": "mixed_bf16", "ops": {"float32": ["matmul"]}}, model)
    x = torch.randn(2, 4, 16)
    amp.model(x)
    amp.model(x)
    assert len(model.modes) == 1 and isinstance(model.modes[0], PolicyMode)
    assert model.seen["matmul"] == F32 and model.seen["softmax"] == F32  # `@` moved, and the preset's moves
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):  # copies bring their own mode
        clone(x)
        assert clone.seen["matmul"] == F32 and isinstance(clone.modes[0], PolicyMode)
    amp.remove()


def test_other_code_keeps_torch_behaviour():
    amp, _ = run("mixed_bf16")
    with torch.autocast("cpu", dtype=BF16):  # outside a unimp forward: torch's own behaviour
        assert torch.randn(3, dtype=BF16).softmax(-1).dtype == BF16
    amp.remove()


def test_overrides_by_glob_and_type():
    policy = {"extends": "mixed_bf16", "overrides": [
        {"modules": ["pro*"], "compute_dtype": "float32"}, {"types": ["LayerNorm"], "compute_dtype": "bfloat16"}]}
    amp, _ = run(policy)
    report = amp.report()
    assert report.row("proj").compute_dtype == "float32"
    assert report.row("norm").compute_dtype == "bfloat16"
    assert report.row("qkv").compute_dtype == "bfloat16"
    amp.remove()


@pytest.mark.parametrize("preset", ["mixed_bf16", "pure_bf16", "mixed_fp16"])
def test_report_is_json_and_a_table(preset):
    amp, _ = run(preset)
    r = amp.report()
    assert unimp.Report.from_json(r.to_json()).rows == r.rows
    assert "qkv" in str(r) and r.row("<model>").output_dtype == "float32"
    amp.remove()


def test_torchs_single_op_modules_apply_their_ops_rule_at_the_module_boundary(monkeypatch):
    # nn.LayerNorm / nn.Softmax are one op each: while a unimp forward moves that op to float32
    # they run it as the Autocast kernel would (input cast, autocast off), without entering the
    # kernel; the result is the kernel path's, bit for bit, forward and backward
    from unimp_torch import op_overrides

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32),
                                torch.nn.Softmax(-1), torch.nn.Linear(32, 8))
    reference = copy.deepcopy(model)
    amp = unimp.apply("mixed_bf16", model)
    ref_amp = unimp.apply("mixed_bf16", reference)
    for m in reference.modules():  # the kernel path: no boundary forwards
        m.__dict__.pop("forward", None) if m is not reference else None
    assert amp.policy.decide("1", "layer_norm").compute_dtype == "float32"  # expected: from the core
    assert isinstance(model[1].__dict__["forward"], op_overrides.SingleOpForward)
    assert isinstance(model[3].__dict__["forward"], op_overrides.SingleOpForward)
    x = torch.randn(4, 16)
    amp.model(x), ref_amp.model(x)  # first forwards are observed
    seen: dict[str, torch.dtype] = {}
    for i in (1, 3):
        model[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(str(i), (a[0].dtype, o.dtype)))
    calls = []
    real = op_overrides.cast_inputs
    monkeypatch.setattr(op_overrides, "cast_inputs", lambda *a: calls.append(a[0]) or real(*a))
    out = amp.model(x)
    assert calls == []  # neither module entered unimp's kernels
    assert seen == {"1": (BF16, F32), "3": (BF16, F32)}  # low inputs (after a Linear), float32 ops
    ref = ref_amp.model(x)
    assert calls != []  # the kernel path does enter them
    assert torch.equal(out, ref)
    out.sum().backward(), ref.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    # parameters that are not float32 (set by hand here): the module leaves its op to the kernel,
    # which casts them too
    model[1].to(BF16)
    assert amp.model(x).dtype == BF16 and seen["1"] == (BF16, F32)  # the last Linear's output, not cast
    # outside a unimp forward the module is torch's own
    with torch.autocast("cpu", dtype=BF16):
        assert model[3](torch.randn(2, 32, dtype=BF16)).dtype == BF16
    amp.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())
