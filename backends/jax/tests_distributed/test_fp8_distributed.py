"""FP8 in a data-parallel step (shard_map over 2 XLA:CPU devices).

tensorwise and delayed: the same losses as on one device within 3% (tensorwise: each device scales its
half batch by its own amax, so the FP8 rounding differs from the full batch's; delayed: the amaxes are
agreed across the devices, test_fp8_sharded.py checks the state).
"""

import numpy as np
import pytest
from test_distributed import Runner

import unimp
from unimp.conformance.probe import probe_batches

FP8_RTOL = 0.03


@pytest.mark.parametrize("api", ["nnx", "linen"])
@pytest.mark.parametrize("name", ["fp8_tensorwise", "fp8_delayed"])
def test_fp8_data_parallel_matches_one_device(api, name):
    recipe = unimp.load(name).fp8.recipe
    one, two = Runner(unimp.load(name), api, 1), Runner(unimp.load(name), api, 2)
    assert [r.fp8 for r in one.amp.report(*([] if api == "linen" else [np.zeros((1, 1), np.int32)])).rows
            if r.path == "fc1"] == [recipe]
    for b in probe_batches(2):
        poison = np.zeros(len(b.tokens), bool)
        (l1, _), (l2, _) = one.step(b, poison), two.step(b, poison)
        assert abs(float(l1) - float(l2)) <= FP8_RTOL * abs(float(l1)), (float(l1), float(l2))
