"""unimp keeps no model alive: an applied model (removed or not) is collected once the user drops it."""

from __future__ import annotations

import gc
import types
import weakref

import pytest

import unimp
from unimp.backend import Amp, Backend, applied
from unimp.loss_scale import LossScale


class Model:
    pass


class LifeAmp(Amp):
    def __init__(self, plan, model, optimizer):
        super().__init__(plan, model, optimizer)
        self._state = LossScale(plan.policy.loss_scale).initial_state()

    def loss_scale_state(self):
        return self._state

    def set_loss_scale_state(self, state):
        self._state = state

    def report(self):
        return self.report_header([])

    def _restore(self):
        pass


class LifeBackend(Backend):
    name = "lifetimes"
    framework = "unimp_lifetimes_fw"
    distribution = "unimp-lifetimes"
    model_types = "test_lifetimes.Model"

    def accepts(self, model):
        return isinstance(model, Model)

    def plan(self, request, model=None):
        return request.compile(control={"linear": "layer"}, native={})

    def apply(self, plan, model, optimizer=None, **options):
        return LifeAmp(plan, model, optimizer)


@pytest.fixture(autouse=True, scope="module")
def backend():
    import sys

    sys.modules.setdefault("unimp_lifetimes_fw", types.ModuleType("unimp_lifetimes_fw"))
    unimp.register_backend(LifeBackend)


@pytest.mark.parametrize("remove", [True, False], ids=["removed", "not-removed"])
def test_an_applied_model_is_collected_and_leaves_no_entry(remove):
    model = Model()
    ref = weakref.ref(model)
    amp = unimp.apply("mixed_bf16", model, backend="lifetimes")
    assert applied.is_applied(model) and id(model) in applied._applied
    if remove:
        amp.remove()
    del model, amp
    gc.collect()
    assert ref() is None
    assert not any(r() is None for r in applied._applied.values() if isinstance(r, weakref.ref))


def test_a_deep_copy_is_collected_too():
    import copy

    model = Model()
    amp = unimp.apply("mixed_bf16", model, backend="lifetimes")
    twin = copy.deepcopy(amp)
    ref = weakref.ref(twin.model)
    assert applied.is_applied(twin.model)
    del twin
    gc.collect()
    assert ref() is None
    amp.remove()


def test_sweep_of_dropped_amps_leaves_no_mark_under_random_collections():
    """The sweep pattern on the core alone: 200 applies dropped without remove(), in cycles, collections at
    random lines of unimp's code (the marks' weakref callbacks run there) and freezes; every mark goes."""
    from unimp.conformance.stress import sweep

    def trial(preset):
        model = Model()
        return model, unimp.apply(preset, model, backend="lifetimes")

    gcs = sweep(trial, ["mixed_bf16", "fp32"], 200, seed=3, timeout=60)
    gc.collect()
    assert gcs.inside["claim"] > 0
    assert not any(isinstance(r, weakref.ref) and r() is None for r in applied._applied.values())
    assert not [o for o in gc.get_objects() if isinstance(o, Model)]


def test_racing_applies_to_one_model_one_wins():
    """Two threads (a trainer and a data-loader thread) applying to one model: 100 of 100 races end with one
    Amp and one AlreadyAppliedError naming the model."""
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(100):
            model, barrier, out = Model(), threading.Barrier(2), []

            def run(model, barrier, out):
                barrier.wait()
                try:
                    out.append(unimp.apply("mixed_bf16", model, backend="lifetimes"))
                except unimp.AlreadyAppliedError as e:
                    out.append(e)

            threads = [threading.Thread(target=run, args=(model, barrier, out)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(type(o).__name__ for o in out) == ["AlreadyAppliedError", "LifeAmp"], out
            assert f"this Model (id 0x{id(model):x}) already has a unimp policy applied" in str(
                next(o for o in out if isinstance(o, Exception)))
            next(o for o in out if isinstance(o, Amp)).remove()
            assert not applied.is_applied(model)
    finally:
        sys.setswitchinterval(interval)


def test_ctrl_c_at_any_line_of_apply_rolls_back_the_applied_mark():
    """A KeyboardInterrupt at every line the core runs in unimp.apply (claim, snapshot, marks, the final
    bookkeeping): the model is never left marked applied without an Amp, and apply works again after."""
    from unimp.conformance.stress import interrupts

    model = Model()
    files = ("unimp/backend/registry.py", "unimp/backend/applied.py", "unimp/backend/transaction.py",
             "unimp/backend/adapter.py", "unimp/backend/amp.py")
    where = []
    for at in interrupts(files, lambda: unimp.apply("mixed_bf16", model, backend="lifetimes"),
                         lambda amp: amp.remove()):
        where.append(at)
        assert not applied.is_applied(model), at
        assert not getattr(applied._local, "journal", None), at
    assert any(w and "applied.py" in w for w in where) and any(w and "registry.py" in w for w in where)
    unimp.apply("mixed_bf16", model, backend="lifetimes").remove()


def test_a_failed_claim_changes_nothing_and_a_failed_remove_can_be_retried():
    model = Model()
    amp = unimp.apply("mixed_bf16", model, backend="lifetimes")
    with pytest.raises(unimp.AlreadyAppliedError, match=r"this Model \(id 0x[0-9a-f]+\) already has a unimp policy"):
        unimp.apply("mixed_bf16", model, backend="lifetimes")
    assert applied.is_applied(model)
    calls = []

    def failing():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("disk gone")

    amp._restore = failing
    with pytest.raises(OSError):
        amp.remove()
    assert applied.is_applied(model) and not amp._removed
    assert amp.remove() is model and not applied.is_applied(model) and len(calls) == 2
