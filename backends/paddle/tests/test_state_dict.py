"""Garbage state dicts through the Paddle Amps (dygraph and static): one StateError, nothing applied
(issue 14, item 13)."""

import contextlib

import paddle
import pytest

import unimp
from unimp.conformance.state_dicts import amp_checks, check_removed

CASES = [("dygraph", "mixed_fp16"), ("dygraph", "paddle_o2"), ("dygraph", "mixed_bf16"), ("static", "paddle_static_o1")]


@contextlib.contextmanager
def _mode(mode):
    if mode != "static":
        yield
        return
    paddle.enable_static()
    try:
        yield
    finally:
        paddle.disable_static()


def _apply(mode, policy):
    if mode == "static":
        with _mode(mode):
            main, start = paddle.static.Program(), paddle.static.Program()
            with paddle.static.program_guard(main, start):
                x = paddle.static.data("x", [4, 8], "float32")
                paddle.mean(paddle.static.nn.fc(x, 8))
            return unimp.apply(unimp.load(policy).replace(on_unsupported="fallback"), main)
    model = paddle.nn.Linear(8, 8)
    amp = unimp.apply(unimp.load(policy).replace(on_unsupported="fallback"), model,
                      paddle.optimizer.SGD(0.1, parameters=model.parameters()))
    amp.backward(amp.model(paddle.ones([4, 8])).astype("float32").mean())
    amp.optimizer.step()
    return amp


@pytest.fixture(scope="module", params=CASES, ids=str)
def amp(request):
    a = _apply(*request.param)
    yield a
    with _mode(request.param[0]):
        a.remove()


(test_garbage_state_dicts_are_refused_and_change_nothing, test_the_largest_valid_state_round_trips,
 test_deepcopy_of_the_amp_works_or_is_refused_clearly) = amp_checks()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_removed_amp_refuses(case):
    amp = _apply(*case)
    with _mode(case[0]):
        check_removed(amp)
