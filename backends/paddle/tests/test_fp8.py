"""FP8 policies on Paddle: a clear UnsupportedError naming what is missing, or the reported fallback."""

import paddle
import pytest

import unimp


def mlp():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(16, 32), paddle.nn.ReLU(), paddle.nn.Linear(32, 16))


@pytest.mark.parametrize("preset", ["fp8_tensorwise", "fp8_rowwise", "te_delayed"])
def test_fp8_is_refused_naming_what_is_missing(preset):
    model = mlp()
    with pytest.raises(unimp.UnsupportedError, match=r"unimp-paddle has no FP8 training path: paddle\.amp "
                                                     r"\(auto_cast/decorate\) runs float16/bfloat16 only"):
        unimp.apply({"extends": preset, "compute_dtype": "float32"}, model,
                    paddle.optimizer.SGD(parameters=model.parameters()))


def test_fp8_fallback_runs_the_compute_dtype_and_reports_it():
    model = mlp()
    amp = unimp.apply({"extends": "fp8_tensorwise", "compute_dtype": "float32", "on_unsupported": "fallback"},
                      model, paddle.optimizer.SGD(parameters=model.parameters()))
    assert amp.plan.fp8.requested and not amp.plan.fp8.active
    x = paddle.randn([4, 16])
    loss = amp.model(x).astype("float32").square().mean()
    amp.backward(loss)
    amp.optimizer.step()
    report = amp.report(x)
    assert {r.fp8 for r in report.rows} == {None}
    assert any(n.startswith("fp8: fallback to the compute dtype: unimp-paddle has no FP8") for n in report.notes)
    amp.remove()
