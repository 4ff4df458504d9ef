"""Dygraph path: what Paddle is given (tracer AMP state), per-layer guards, errors, skips, remove()."""

import numpy as np
import paddle
import pytest

import unimp
from unimp.conformance import probe_batches, probe_weights
from unimp.policy.ops import CANONICAL_OPS
from unimp_paddle.ops import NATIVE_OPS


def _expected_types(policy, category):
    """Paddle op types the core's vocabulary puts in one category of the policy."""
    return {n for op in CANONICAL_OPS if policy.ops.category(op) == category
            for n in NATIVE_OPS.get(op, ()) if n[:1].islower()}


def _record_tracer(model, seen):
    def hook(layer, _inputs, path=None):
        tracer = paddle.base.framework._dygraph_tracer()
        white, black = tracer._get_amp_op_list()
        seen[path] = (set(white), set(black), str(tracer._amp_dtype), str(tracer._amp_level))
    for path, layer in model.named_sublayers():
        layer.register_forward_pre_hook(lambda la, i, p=path: hook(la, i, p))


def _fallback(policy):
    return unimp.load(policy).replace(on_unsupported="fallback")


@pytest.mark.parametrize("name", ["mixed_bf16", "custom", "paddle_o1"])
def test_paddle_is_given_the_compiled_lists(kit, name):
    policy = _fallback(name if name != "custom" else unimp.conformance.CUSTOM_MOVED_OPS)
    policy = policy.replace(overrides=[])
    model = kit.build_probe(probe_weights())
    seen = {}
    amp = unimp.apply(policy, model, kit.make_optimizer(model))
    _record_tracer(model, seen)
    amp.model(paddle.to_tensor(probe_batches(1)[0].tokens.astype("int64")))
    white, black, _dtype, _level = seen["embed"]
    lower, f32 = _expected_types(policy, "lower"), _expected_types(policy, "float32")
    assert lower <= white and not (lower & black)
    assert f32 <= black and not (f32 & white)
    neither = _expected_types(policy, "promote") | _expected_types(policy, "inputs")
    assert not (neither & (white | black))
    assert amp.native["auto_cast"]["level"] == "O1"
    assert amp.native["auto_cast"]["dtype"] == policy.compute_dtype
    amp.remove()


def test_the_op_lists_are_compiled_once_into_the_plans_details(kit):
    """The Plan's details hold Paddle's lists (typed: white/black/gray op types), compiled with the Plan; the
    Amp runs those, never recomputing them from the Plan's ops at apply time."""
    policy = _fallback("mixed_bf16").replace(overrides=[])
    model = kit.build_probe(probe_weights())
    amp = unimp.apply(policy, model, kit.make_optimizer(model))
    lists = amp.plan.details.lists
    assert _expected_types(policy, "lower") <= lists.white and _expected_types(policy, "float32") <= lists.black
    assert (_expected_types(policy, "promote") | _expected_types(policy, "inputs")) <= lists.gray | lists.black
    assert amp.lists is lists
    amp.remove()


def test_overrides_and_linear_get_their_own_guard(kit):
    """Paddle's Linear runs matmul_v2: a policy with linear != matmul needs a per-layer auto_cast."""
    policy = _fallback(unimp.conformance.CUSTOM_MOVED_OPS).replace(
        overrides=[{"modules": ["hea*"], "compute_dtype": "float32"}])
    model = kit.build_probe(probe_weights())
    amp = unimp.apply(policy, model, kit.make_optimizer(model))
    layers = amp.native["layers"]
    for path in ("fc1", "head"):  # linear -> float32 by the op list; head also by the override
        assert policy.decide(path, "linear").compute_dtype == "float32"
        assert "matmul_v2" in layers[path]["custom_black_list"]
        assert "matmul_v2" not in layers[path]["custom_white_list"]
    assert "conv" not in layers and "embed" not in layers  # op-level lists suffice there
    assert "matmul_v2" in amp.native["auto_cast"]["custom_white_list"]  # matmul -> bfloat16 elsewhere
    amp.remove()
    assert "forward" not in model.fc1.__dict__


def test_cpu_plan_reports_float32_and_errors_name_the_fix(kit):
    model = kit.build_probe(probe_weights())
    with pytest.raises(unimp.UnsupportedError, match="on_unsupported"):
        unimp.apply("mixed_bf16", model, kit.make_optimizer(model))
    amp = unimp.apply(_fallback("mixed_bf16"), model, kit.make_optimizer(model))
    assert amp.plan.op("matmul").dtype == "float32" and not amp.plan.op("matmul").honoured
    assert "CPU" in amp.plan.op("matmul").note
    assert "float32" in str(amp.report(paddle.to_tensor(probe_batches(1)[0].tokens.astype("int64"))))
    amp.remove()


def test_bad_arguments_are_clear(kit):
    model = kit.build_probe(probe_weights())
    with pytest.raises(TypeError, match="optimizer"):
        unimp.apply(_fallback("fp32"), model, object())
    with pytest.raises(unimp.PolicyError, match="ops.lower"):
        unimp.apply({"ops": {"lower": ["matmull"]}}, model)
    unimp.apply(_fallback("fp32"), model, kit.make_optimizer(model)).remove()  # nothing was left applied


def test_skipped_step_changes_nothing_and_counts(kit):
    policy = _fallback("mixed_fp16")
    model = kit.build_probe(probe_weights())
    amp = unimp.apply(policy, model, kit.make_optimizer(model))
    b = probe_batches(2)
    kit.step(amp, b[0])
    before = kit.snapshot(amp)
    kit.step(amp, b[1], poison=True)
    after = kit.snapshot(amp)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert amp.skipped_steps == 1 and amp.scale == 32768.0
    amp.remove()


cuda = pytest.mark.skipif(not paddle.device.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0,
                          reason="no CUDA Paddle here (paddlepaddle CPU wheel): Paddle's dygraph AMP only "
                                 "runs on CUDA; these tests run the same code path there")


@cuda
def test_cuda_o1_runs_bf16_matmul_and_fp32_softmax(kit):
    paddle.device.set_device("gpu")
    model = kit.build_probe(probe_weights())
    amp = unimp.apply("mixed_bf16", model, kit.make_optimizer(model))
    seen = amp.observe(paddle.to_tensor(probe_batches(1)[0].tokens.astype("int64")))
    assert seen["fc1"][1]["output"] == "bfloat16" and seen["norm"][1]["output"] == "float32"
    amp.remove()


@cuda
def test_cuda_o2_decorates_with_master_weights(kit):
    paddle.device.set_device("gpu")
    from unimp.conformance import run_case
    for case in unimp.conformance.cases(("pure_bf16",)):
        run_case(case, kit)


# ---------------------------------------------------------------- reported fallbacks (CPU)
@pytest.mark.skipif(paddle.device.get_device() != "cpu", reason="CPU fallback facts")
@pytest.mark.parametrize("name, named", [
    ("pure_bf16", "param_dtype = 'bfloat16'"),
    ("custom", "overrides[0].compute_dtype = 'bfloat16'"),
])
def test_error_mode_names_params_or_override_and_the_fix(kit, name, named):
    policy = unimp.load(unimp.conformance.CUSTOM_MOVED_OPS if name == "custom" else name)
    assert policy.on_unsupported == "error"
    model = kit.build_probe(probe_weights())
    with pytest.raises(unimp.UnsupportedError) as e:
        unimp.apply(policy, model, kit.make_optimizer(model))
    assert named in str(e.value) and "on_unsupported" in str(e.value) and "fix:" in str(e.value)
    unimp.apply(_fallback("fp32"), model, kit.make_optimizer(model)).remove()  # nothing was left applied


@pytest.mark.skipif(paddle.device.get_device() != "cpu", reason="CPU fallback facts")
def test_fallback_plan_declares_params_and_overrides_and_they_hold(kit):
    """pure_bf16 + a bf16 override: the Plan says float32 for both, and float32 is what ran."""
    policy = _fallback("pure_bf16").replace(overrides=[{"modules": ["hea*"], "compute_dtype": "bfloat16"}])
    model = kit.build_probe(probe_weights())
    amp = unimp.apply(policy, model, kit.make_optimizer(model))
    assert amp.plan.param_fallback == "float32" and dict(amp.plan.override_fallbacks) == {0: "float32"}
    assert amp.plan.to_dict()["param_fallback"] == "float32"
    seen = amp.observe(paddle.to_tensor(probe_batches(1)[0].tokens.astype("int64")))
    assert {obs["param"] for _k, obs in seen.values() if obs["param"]} == {"float32"}
    assert seen["head"][1]["output"] == "float32"
    notes = " ".join(amp.report().notes)
    assert "param_dtype" in notes and "overrides[0]" in notes
    amp.remove()


def test_kit_applies_honourable_policies_unchanged(kit):
    """fp32-based policies keep their fingerprint (so another backend's checkpoint loads strictly);
    only a policy Paddle cannot run here gets the declared fallback variant."""
    model = kit.build_probe(probe_weights())
    fp32 = unimp.load("fp32")
    amp = kit.apply(fp32, model, kit.make_optimizer(model))
    assert amp.policy.fingerprint == fp32.fingerprint
    amp.remove()
    amp = kit.apply(unimp.load("mixed_bf16"), model, kit.make_optimizer(model))
    assert amp.policy.on_unsupported == ("fallback" if paddle.device.get_device() == "cpu" else "error")
    amp.remove()


# ---------------------------------------------------------------- export_weights
def test_export_weights_is_the_probe_layout(kit):
    weights = probe_weights(3)
    model = kit.build_probe(weights)
    amp = kit.apply(unimp.load("fp32"), model, kit.make_optimizer(model))
    out = kit.export_weights(amp)
    assert set(out) == set(weights)
    for k, v in weights.items():
        assert out[k].dtype == np.float32 and np.array_equal(out[k], v), k


def test_exported_weights_rebuild_the_trained_model(kit):
    model = kit.build_probe(probe_weights())
    amp = kit.apply(unimp.load("fp32"), model, kit.make_optimizer(model))
    b = probe_batches(3)
    kit.step(amp, b[0])
    kit.step(amp, b[1])
    rebuilt = kit.build_probe(kit.export_weights(amp))
    assert not np.array_equal(kit.export_weights(amp)["fc1.weight"], probe_weights()["fc1.weight"])
    np.testing.assert_array_equal(kit.forward_fingerprint(rebuilt, b[2]), kit.forward_fingerprint(amp.model, b[2]))
    amp.remove()


class _LowOutput(paddle.nn.Layer):
    """Ends in an op whose output is bfloat16 on any place (a cast): CPU Paddle has no low-precision AMP."""

    def __init__(self):
        super().__init__()
        self.fc = paddle.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x).astype("bfloat16")


@pytest.mark.parametrize("output", ["unchanged", "float32", "float16"])
def test_output_dtype_unchanged_leaves_the_last_ops_dtype_and_a_dtype_casts(output):
    paddle.seed(0)
    model, x = _LowOutput(), paddle.randn([2, 8])
    with paddle.amp.auto_cast():  # Paddle's own (python/paddle/amp/auto_cast.py): outputs as the ops made them
        native = model(x).dtype
    amp = unimp.apply(unimp.load("fp32").replace(output_dtype=output), model, None)
    want = native if output == "unchanged" else getattr(paddle, output)
    assert native == paddle.bfloat16 and amp.model(x).dtype == want
    amp.remove()
    assert model(x).dtype == paddle.bfloat16
