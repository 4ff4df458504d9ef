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
