"""Static path (legacy IR): the compiled lists are the dtypes that really ran in bf16 on CPU.

Whether Paddle's oneDNN has bf16 kernels on this CPU comes from unimp.hardware (AVX512 BW/VL/DQ or
AVX-NE-CONVERT); without them the whole Program runs float32 and the Plan says why. `tox -e hwsim`
reruns this file under a simulated AVX2-only CPU.
"""

import numpy as np
import paddle
import pytest

import unimp
import unimp.conformance
from unimp import hardware
from unimp.plan import requested_dtype
from unimp_paddle.ops import canonical_of

pytestmark = pytest.mark.hardware
BF16 = "bfloat16" if hardware.cpu().bf16_kernels else "float32"  # what Paddle can run here


@pytest.fixture
def static_mode():
    paddle.enable_static()
    yield
    paddle.disable_static()


def _mlp():
    main, start = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, start):
        x = paddle.static.data("x", [64, 32], "float32")
        y = paddle.static.data("y", [64, 1], "int64")
        h = paddle.static.nn.fc(x, 64, activation="relu")
        z = paddle.static.nn.fc(h, 8)
        loss = paddle.mean(paddle.nn.functional.cross_entropy(z, y))
    rng = np.random.default_rng(0)
    feed = {"x": rng.random((64, 32), dtype=np.float32), "y": rng.integers(0, 8, (64, 1))}
    return main, start, loss, feed


def _probe_forward():
    main, start = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, start):
        tok = paddle.static.data("tok", [32], "int64")
        h = paddle.nn.Embedding(32, 16)(tok)
        h = paddle.static.nn.fc(h, 32, activation="relu")
        h = paddle.static.nn.fc(h, 8)
        paddle.nn.functional.log_softmax(h, -1)
    return main, start, {"tok": np.arange(32, dtype=np.int64)}


def _expected(amp, op_type, var):
    """The dtype the core's policy asks for this op, unless the Plan/findings report a fallback."""
    kind = canonical_of(op_type)
    d = amp.plan.op(kind)
    if var in amp.fp32_vars or not d.honoured:
        return "float32"
    return requested_dtype(amp.policy, kind, amp.plan.compute_dtype)


def _check(amp, exe, feed):
    ran = amp.op_dtypes(exe, feed)
    assert any(dtype == "bfloat16" for _, _, dtype in ran) is (BF16 == "bfloat16"), ran
    for op_type, var, dtype in ran:
        want = _expected(amp, op_type, var)
        if want is not None:  # follow-inputs / promote ops: Paddle's gray rule, checked via neighbours
            assert dtype == want, (op_type, var, dtype, want)
    return ran


def test_mixed_bf16_trains_with_bf16_mul_on_cpu(static_mode):
    main, start, loss, feed = _mlp()
    amp = unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), main,
                      paddle.optimizer.Adam(0.01))
    amp.optimizer.minimize(loss, start)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(start)
    losses = [float(exe.run(main, feed=feed, fetch_list=[loss])[0]) for _ in range(5)]
    assert losses[-1] < losses[0]
    ran = _check(amp, exe, feed)
    assert ("mul", BF16) in {(t, d) for t, _, d in ran}
    if BF16 == "float32":  # the Plan says what really ran, and why
        assert not amp.plan.op("matmul").honoured and "no bfloat16 matmul kernel" in amp.plan.op("matmul").note


def test_moved_ops_run_where_the_policy_puts_them(static_mode):
    policy = unimp.load(unimp.conformance.CUSTOM_MOVED_OPS).replace(on_unsupported="fallback", overrides=[])
    main, start, feed = _probe_forward()
    amp = unimp.apply(policy, main)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(start)
    ran = {t: d for t, _, d in _check(amp, exe, feed)}
    assert ran["lookup_table_v2"] == ran["log_softmax"] == ran["mul"] == BF16  # moved to lower


def test_float32_override_by_parameter_name(static_mode):
    policy = unimp.load("mixed_bf16").replace(
        on_unsupported="fallback", overrides=[{"modules": ["fc_1"], "compute_dtype": "float32"}])
    main, start, _loss, feed = _mlp()
    amp = unimp.apply(policy, main)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(start)
    muls = [d for t, _, d in amp.op_dtypes(exe, feed) if t == "mul"]
    assert muls == [BF16, "float32"]


def test_remove_restores_the_program_and_errors_are_clear(static_mode):
    main, _start, _loss, _feed = _mlp()
    before = [op.type for op in main.global_block().ops]
    amp = unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), main)
    assert ([op.type for op in main.global_block().ops] != before) is (BF16 == "bfloat16")  # bf16 casts
    assert amp.remove() is main
    assert [op.type for op in main.global_block().ops] == before
    with pytest.raises(unimp.UnsupportedError, match="on_unsupported"):
        unimp.apply("mixed_bf16", main)  # elementwise ops cannot run bf16 on CPU: error by default
    with pytest.raises(unimp.UnsupportedError, match="loss scaling"):
        unimp.apply("paddle_o1", main)


def test_auto_is_bf16_only_with_native_units_and_explicit_bf16_never_reaches_onednns_error(static_mode):
    main, start, loss, feed = _mlp()
    policy = unimp.load({"extends": "mixed_bf16", "compute_dtype": "auto", "on_unsupported": "fallback"})
    auto = unimp.get_backend("paddle").compile(policy, main)
    facts = hardware.cpu()
    assert auto.compute_dtype == ("bfloat16" if facts.native_bf16 else "float32")
    assert facts.describe() in auto.compute_reason
    amp = unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), main, paddle.optimizer.SGD(0.1))
    amp.optimizer.minimize(loss, start)
    exe = paddle.static.Executor(paddle.CPUPlace())
    exe.run(start)
    assert np.isfinite(exe.run(main, feed=feed, fetch_list=[loss])[0])  # no 'could not create a primitive'


BACKSTOP = """
import numpy as np, paddle, unimp
paddle.enable_static()
main, start = paddle.static.Program(), paddle.static.Program()
with paddle.static.program_guard(main, start):
    x = paddle.static.data("x", [4, 16], "float32")
    out = paddle.static.nn.fc(x, 8)
amp = unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), main)
exe = paddle.static.Executor(paddle.CPUPlace())
exe.run(start)
try:
    amp.op_dtypes(exe, {"x": np.ones((4, 16), np.float32)})
except unimp.UnsupportedError as e:
    print("UnsupportedError:", e)
"""


@pytest.mark.skipif(not hardware.host().bf16_kernels, reason="needs a CPU whose oneDNN has bf16 kernels to cap")
def test_onednn_failing_anyway_is_a_unimp_error_not_paddles_runtime_error():
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}  # oneDNN capped, unimp's facts not told
    env.pop(hardware.ENV, None)
    out = subprocess.run([sys.executable, "-c", BACKSTOP], env=env, capture_output=True, text=True, timeout=300)
    assert "UnsupportedError: Paddle's oneDNN has no kernel" in out.stdout, out.stderr[-2000:]
    assert 'compute_dtype = "auto"' in out.stdout
