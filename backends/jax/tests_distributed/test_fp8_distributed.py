"""FP8 in a data-parallel step (shard_map over 2 XLA:CPU devices).

tensorwise: the same losses as on one device within 3% (each device scales its half batch by its own
amax, so the FP8 rounding differs from the full batch's); delayed: a clear UnsupportedError (its
scaling state is not reduced across devices yet).
"""

import numpy as np
import pytest
from test_distributed import Runner

import unimp
from unimp.conformance.probe import probe_batches

FP8_RTOL = 0.03


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_tensorwise_fp8_data_parallel_matches_one_device(api):
    one, two = Runner(unimp.load("fp8_tensorwise"), api, 1), Runner(unimp.load("fp8_tensorwise"), api, 2)
    assert [r.fp8 for r in one.amp.report(*([] if api == "linen" else [np.zeros((1, 1), np.int32)])).rows
            if r.path == "fc1"] == ["tensorwise"]
    for b in probe_batches(2):
        poison = np.zeros(len(b.tokens), bool)
        (l1, _), (l2, _) = one.step(b, poison), two.step(b, poison)
        assert abs(float(l1) - float(l2)) <= FP8_RTOL * abs(float(l1)), (float(l1), float(l2))


@pytest.mark.parametrize("api", ["nnx", "linen"])
def test_delayed_fp8_data_parallel_is_refused(api):
    runner = Runner(unimp.load("fp8_delayed"), api, 2)
    b = probe_batches(1)[0]
    with pytest.raises(unimp.UnsupportedError, match="delayed FP8.*tensorwise"):
        runner.step(b, np.zeros(len(b.tokens), bool))
