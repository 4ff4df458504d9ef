"""The numerics watch's core: dtype limits, records, the first-non-finite order, the Watch handle, the JSON-lines
writer and the report's numerics view (no framework; the backends' tests run it on real training steps)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from unimp.dtypes import FLT_MAX, limits
from unimp.report import Report, ReportRow
from unimp.watch import Event, LayerStats, Origin, StepRecord, Watch, first_nonfinite, read_records
from unimp.watch.summary import SKIPPED_KEPT, Summary

COUNTS = {"nonfinite": 0, "overflow": 0, "underflow": 0, "subnormal": 0, "zero": 0, "numel": 8}

# ------------------------------------------------------------------ limits (IEEE 754 and the OCP FP8 spec's tables)


@pytest.mark.parametrize(("dtype", "largest", "normal", "subnormal"), [
    ("float16", 65504.0, 2.0 ** -14, 2.0 ** -24),
    ("bfloat16", 3.3895313892515355e38, 2.0 ** -126, 2.0 ** -133),
    ("float32", FLT_MAX, 2.0 ** -126, 2.0 ** -149),
    ("float64", sys.float_info.max, sys.float_info.min, 5e-324),
    ("float8_e4m3fn", 448.0, 2.0 ** -6, 2.0 ** -9),
    ("float8_e5m2", 57344.0, 2.0 ** -14, 2.0 ** -16),
])
def test_limits_are_the_formats_published_values(dtype, largest, normal, subnormal):
    assert tuple(limits(dtype)) == (largest, normal, subnormal)
    assert limits(f"torch.{dtype}") == limits(dtype)  # a framework's dtype text reads the same


def test_cast_boundaries_round_to_nearest_even():
    # float16: max 65504 has an odd last mantissa bit, its ulp is 32, so 65520 ties to 65536 = inf; the
    # smallest subnormal 2^-24 halves to 2^-25 (ties to 0); 2^-14 - 2^-25 ties to the normal 2^-14
    f16 = limits("float16")
    assert (f16.overflow_at, f16.underflow_at, f16.normal_from) == (65520.0, 2.0 ** -25, 2.0 ** -14 - 2.0 ** -25)
    assert limits("float8_e4m3fn").overflow_at == 464.0  # ulp 32 at 448
    assert limits("float8_e5m2").overflow_at == 61440.0  # ulp 8192 at 57344
    assert limits("float32").overflow_at == 2.0 ** 128 - 2.0 ** 103


def test_unknown_dtype_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="int8.*known: float16"):
        limits("int8")


# ------------------------------------------------------------------ records


def test_layer_stats_are_fractions_of_the_counts():
    s = LayerStats.from_counts("fc", "grad_output", "float16", 2.5,
                               {**COUNTS, "nonfinite": 1, "overflow": 1, "underflow": 2, "subnormal": 3, "zero": 4})
    assert (s.direction, s.numel, s.nonfinite, s.overflow, s.underflow, s.subnormal, s.zero) == (
        "backward", 8, 1 / 8, 1 / 8, 2 / 8, 3 / 8, 4 / 8)
    assert LayerStats.from_counts("fc", "output", "float16", 0.0, {**COUNTS, "numel": 0}).zero == 0.0
    with pytest.raises(ValueError, match="unknown tensor place 'weights'"):
        LayerStats.from_counts("fc", "weights", "float16", 0.0, COUNTS)


def test_a_record_round_trips_through_its_dict_and_json():
    s = LayerStats.from_counts("h.0", "output", "float16", math.inf, COUNTS)
    r = StepRecord(9, True, 1024.0, True, (s,), Origin("h.0", "grad_input"), ("a note",))
    assert StepRecord.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    d = r.to_dict()
    assert d["first_nonfinite"] == {"path": "h.0", "direction": "backward", "tensor": "grad_input", "exact": True}
    assert d["layers"][0]["direction"] == "forward"


# ------------------------------------------------------------------ the first non-finite value


def test_the_forward_comes_before_the_loss_and_the_backward():
    events = [Event("b", "grad_output", 0, False), Event("<loss>", "loss", None, False),
              Event("a", "output", 5, True), Event("c", "output", 9, False)]
    assert first_nonfinite(events) == Origin("c", "output")
    events[3] = Event("c", "output", 9, True)
    assert first_nonfinite(events) == Origin("<loss>", "loss")
    assert first_nonfinite(events[:1] + events[2:]) == Origin("b", "grad_output")
    assert first_nonfinite([Event("a", "output", 0, True)]) is None


def test_within_a_pass_the_earliest_position_wins():
    # an inner layer returns before the layer that holds it: the inner one is named
    events = [Event("block", "output", 3, False), Event("block.fc", "output", 2, False),
              Event("block.norm", "input", 1, False), Event("emb", "output", 0, True)]
    assert first_nonfinite(events) == Origin("block.norm", "input")
    backward = [Event("head", "grad_output", 0, True), Event("head", "grad_input", 1, True),
                Event("fc", "grad_output", 2, True), Event("fc", "grad_input", 3, False),
                Event("emb", "grad_output", 4, False)]
    assert first_nonfinite(backward) == Origin("fc", "grad_input")


def test_a_parameter_gradient_sits_in_its_layers_backward():
    events = [Event("head", "grad_output", 0, True), Event("fc", "grad_output", 2, True),
              Event("fc", "grad_input", 3, False), Event("fc", "grad_param", None, False),
              Event("head", "grad_param", None, True)]
    # after the gradient reached fc's output (2), before fc's input gradient (3)
    assert first_nonfinite(events) == Origin("fc", "grad_param")
    # a non-finite value arriving at fc's output came first
    events[1] = Event("fc", "grad_output", 2, False)
    assert first_nonfinite(events) == Origin("fc", "grad_output")


def test_without_positions_parameter_gradients_follow_the_backward_order():
    events = [Event("fc1", "grad_param", None, False), Event("fc2", "grad_param", None, False),
              Event("head", "grad_param", None, True), Event("<loss>", "loss", None, True)]
    assert first_nonfinite(events, backward_order=["head", "fc2", "fc1"]) == Origin("fc2", "grad_param", exact=False)
    assert first_nonfinite(events, backward_order=["head", "fc1", "fc2"]) == Origin("fc1", "grad_param", exact=False)
    # a positioned backward event comes before the unpositioned ones
    positioned = [*events, Event("head", "grad_input", 1, False)]
    assert first_nonfinite(positioned, backward_order=["head", "fc2", "fc1"]) == Origin("head", "grad_input")


# ------------------------------------------------------------------ the Watch handle


def _stats(path="fc", tensor="output", amax=1.0, **counts):
    return (path, tensor, "float16", amax, {**COUNTS, **counts})


def test_sampling_starts_at_the_first_watched_step():
    w = Watch(every=3)
    assert not w.sampled(0)  # not bound yet
    w.bind(start_step=7, stop=lambda: None)
    assert [s for s in range(20) if w.sampled(s)] == [7, 10, 13, 16, 19]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"every": 0}, r"every=0.*int >= 1"), ({"every": 2.5}, r"every=2.5"), ({"every": True}, r"every=True"),
    ({"keep": -1}, r"keep=-1"), ({"localize": "yes"}, r"localize='yes'"), ({"path": 3}, r"path=3.*file name")])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Watch(**kwargs)


def test_bad_paths_are_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="is a directory; name a file"):
        Watch(path=tmp_path)
    with pytest.raises(ValueError, match="does not exist; create it first"):
        Watch(path=tmp_path / "missing" / "n.jsonl")


def test_records_are_kept_bounded_and_written_as_json_lines(tmp_path):
    path = tmp_path / "numerics.jsonl"
    seen = []
    w = Watch(every=1, path=path, keep=2)
    w.add_writer(seen.append)
    w.bind(0, lambda: None)
    for step in range(3):
        w.add(step, skipped=step == 1, scale=2.0 ** 16, sampled=True, layers=[_stats(amax=math.inf if step else 1.0)],
              events=[("fc", "output", 0, step != 1)])
    assert [r["step"] for r in w.records] == [1, 2] and len(w) == 2  # the last keep=2
    assert [r["step"] for r in seen] == [0, 1, 2]
    assert [r["step"] for r in w.skipped] == [1]
    w.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[2])["layers"][0]["amax"] == "inf"  # strict JSON
    assert read_records(path) == seen  # and read back as floats
    Watch(path=path).close()  # appended to, never truncated
    assert len(path.read_text().splitlines()) == 3


def test_a_skipped_step_names_its_first_nonfinite_value_or_says_why_not():
    w = Watch()
    w.bind(0, lambda: None)
    r = w.add(4, skipped=True, scale=8.0, sampled=False,
              events=[("h.1", "output", 1, False), ("h.0", "output", 0, True)])
    assert r["first_nonfinite"] == {"path": "h.1", "direction": "forward", "tensor": "output", "exact": True}
    r = w.add(5, skipped=True, scale=4.0, sampled=False, events=[("h.0", "output", 0, True)])
    assert r["first_nonfinite"] is None and "does not see" in r["notes"][0]


def test_close_stops_the_backend_once_and_closes_the_writers(tmp_path):
    stops, closed = [], []

    class Writer:
        def __call__(self, record):
            pass

        def close(self):
            closed.append(True)

    w = Watch(path=tmp_path / "n.jsonl")
    w.add_writer(Writer())
    w.bind(0, lambda: stops.append(True))
    with w:
        pass
    w.close()
    assert (stops, closed, w.closed) == ([True], [True], True)
    assert "closed" in repr(w)


def test_summary_keeps_the_worst_per_layer_and_a_bounded_list_of_skips():
    s = Summary()
    s.add(StepRecord(0, False, 1.0, True, (LayerStats.from_counts(*_stats(amax=2.0, subnormal=1)),)))
    s.add(StepRecord(1, False, 1.0, True, (LayerStats.from_counts(*_stats(amax=5.0, overflow=2)),)))
    for step in range(SKIPPED_KEPT + 5):
        s.add(StepRecord(step + 2, True, 1.0, False, origin=Origin("fc", "output")))
    d = s.to_dict()
    (row,) = d["layers"]
    assert (row["steps"], row["amax_max"], row["subnormal_max"], row["overflow_max"]) == (2, 5.0, 1 / 8, 2 / 8)
    assert d["skipped_steps"] == SKIPPED_KEPT + 5 and len(d["skipped"]) == SKIPPED_KEPT
    assert d["skipped"][-1] == {"step": SKIPPED_KEPT + 6, "first_nonfinite": "forward: the output of fc"}


def test_the_report_carries_and_prints_the_numerics_view():
    w = Watch(every=1)
    w.bind(0, lambda: None)
    w.add(0, skipped=False, scale=1.0, sampled=True, layers=[_stats(amax=3.0, subnormal=2)])
    w.add(1, skipped=True, scale=1.0, sampled=False, events=[("fc", "output", 0, False)])
    r = Report([ReportRow("fc", "linear", "float16", "float32", "float16")], numerics=w.numerics())
    assert Report.from_json(r.to_json()) == r
    text = str(r)
    assert "numerics: 1 sampled steps (worst over them), 1 skipped" in text
    assert "skipped step 1: first non-finite value in forward: the output of fc" in text
    assert "numerics" not in str(Report(r.rows))


def test_a_backend_without_a_watch_refuses_it_naming_the_backend():
    import numpy as np
    from test_sixth_backend import NumpyBackend  # registers the NumPy reference backend (tests/sixth_backend)
    from unimp_numpy import nn

    import unimp

    assert NumpyBackend.name in unimp.backends()
    amp = unimp.apply("fp32", nn.Model([("fc", nn.Linear(np.ones((2, 2), np.float32), np.zeros(2, np.float32)))]))
    with pytest.raises(unimp.UnsupportedError, match="the numpy backend has no numerics watch"):
        amp.watch()
    assert amp.report(np.ones((1, 2), np.float32)).numerics is None
    amp.remove()
