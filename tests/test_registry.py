"""Backend discovery, apply/remove bookkeeping and the Amp base, with a pure-Python test plug-in."""

import sys
import types

import pytest

import unimp
from unimp.backend import Amp, Backend
from unimp.loss_scale import LossScale

fw = types.ModuleType("unimp_testfw")


class Model:
    def __init__(self):
        self.weights = {"fc": [1.0, 2.0]}


fw.Model = Model


class ToyAmp(Amp):
    def __init__(self, plan, model, optimizer):
        super().__init__(plan, model, optimizer)
        self._rule = LossScale(plan.policy.loss_scale)
        self._state = self._rule.initial_state()
        self._saved = dict(model.weights)

    def step(self, finite):
        self._state = self._rule.update(self._state, finite).state

    def loss_scale_state(self):
        return self._state

    def set_loss_scale_state(self, state):
        self._state = state

    def report(self):
        return self.report_header([unimp.ReportRow("fc", "linear", "bfloat16", "float32", "bfloat16")])

    def _restore(self):
        self.model.weights = self._saved


class ToyBackend(Backend):
    name = "toy"
    framework = "unimp_testfw"
    distribution = "unimp-toy"
    model_types = "unimp_testfw.Model"

    def accepts(self, model):
        return isinstance(model, Model)

    def plan(self, request, model=None):
        return request.compile(control={"linear": "layer", "matmul": "op"}, native={})

    def apply(self, plan, model, optimizer=None, **options):
        return ToyAmp(plan, model, optimizer)


class GreedyBackend(ToyBackend):
    """Would accept anything, but its framework is never imported."""

    name = "greedy"
    framework = "never_imported_framework_xyz"
    priority = 100

    def accepts(self, model):
        raise AssertionError("a backend whose framework is not imported must not be asked")


@pytest.fixture(autouse=True)
def toy():
    sys.modules["unimp_testfw"] = fw
    unimp.register_backend(ToyBackend)
    unimp.register_backend(GreedyBackend)
    yield
    sys.modules.pop("unimp_testfw", None)


def test_detect_picks_the_backend_whose_framework_is_imported():
    assert unimp.detect(Model()).name == "toy"


def test_no_backend_is_a_clear_error():
    with pytest.raises(TypeError, match=r"no unimp backend accepts <class 'object'>; installed backends: .*toy"):
        unimp.apply("mixed_bf16", object())


def test_unknown_backend_name():
    with pytest.raises(unimp.UnsupportedError, match="backend 'mlx' is not installed.*pip install unimp-mlx"):
        unimp.apply("mixed_bf16", Model(), backend="mlx")


def test_apply_twice_is_refused_until_remove():
    m = Model()
    amp = unimp.apply("mixed_bf16", m)
    with pytest.raises(RuntimeError, match="already has a unimp policy applied"):
        unimp.apply("mixed_bf16", m)
    assert amp.remove() is m
    unimp.apply("mixed_bf16", m).remove()


def test_state_dict_is_canonical_and_checks_the_policy():
    pol = unimp.load("mixed_fp16").replace(loss_scale={"growth_interval": 1})
    amp = unimp.apply(pol, Model())
    amp.step(True)
    amp.step(False)
    sd = amp.state_dict()
    assert set(sd) == {"format", "policy_fingerprint", "scale", "growth_tracker", "hysteresis_left",
                       "skipped", "steps"}
    assert (sd["scale"], sd["skipped"], sd["steps"]) == (65536.0, 1, 2)
    other = unimp.apply(pol, Model())
    other.load_state_dict(sd)
    assert other.scale == 65536.0 and other.skipped_steps == 1
    stranger = unimp.apply("mixed_bf16", Model())
    with pytest.raises(unimp.StateError, match="fingerprint"):
        stranger.load_state_dict(sd)
    with pytest.raises(unimp.StateError, match="keeps the scale at 1.0"):  # strict=False: provenance only
        stranger.load_state_dict(sd, strict=False)
    cousin = unimp.apply(pol.replace(loss_scale={"growth_interval": 5}), Model())
    with pytest.warns(unimp.UnimpWarning, match="strict=False"):
        cousin.load_state_dict(sd, strict=False)
    assert cousin.scale == 65536.0 and cousin.skipped_steps == 1
    with pytest.raises(unimp.StateError, match="not an unimp state_dict"):
        stranger.load_state_dict({"scale": 1.0})


def test_report_header_and_json_round_trip():
    amp = unimp.apply("mixed_bf16", Model())
    r = amp.report()
    assert r.backend == "toy" and r.rows[0].compute_dtype == "bfloat16"
    again = unimp.Report.from_json(r.to_json())
    assert again.diff(r) == []
    again.rows[0] = unimp.ReportRow("fc", "linear", "float32", "float32", "float32")
    assert "fc: compute_dtype float32 != bfloat16" in again.diff(r)
    assert "fc" in str(r) and "compute" in str(r)


def test_fixed_op_the_backend_cannot_honour():
    class Stubborn(ToyBackend):
        name = "stubborn"

        def plan(self, request, model=None):
            return request.compile(control={}, native={},
                               fixed={"softmax": ("bfloat16", "the framework lowers softmax")})

    unimp.register_backend(Stubborn)
    with pytest.raises(unimp.UnsupportedError, match=r"(?s)softmax: policy asks float32, stubborn runs it in "
                                                      r"bfloat16.*on_unsupported = \"fallback\""):
        unimp.apply("mixed_bf16", Model(), backend="stubborn")
    amp = unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), Model(), backend="stubborn")
    assert not amp.plan.op("softmax").honoured and "fallback" in str(amp.plan)


def test_remember_binds_a_wrapper_made_after_apply():
    from unimp.backend.registry import remember

    m, wrapper = Model(), Model()
    amp = unimp.apply("mixed_bf16", m)
    remember(amp, wrapper)
    with pytest.raises(RuntimeError, match="already"):
        unimp.apply("mixed_bf16", wrapper)
    amp.remove()
    unimp.apply("mixed_bf16", wrapper).remove()


def test_a_compiled_plan_is_bound_as_it_is_on_its_backend():
    """``unimp.apply(plan, model)`` binds a Plan compiled before (a ``scope`` holds one) without compiling
    again, all or nothing like a policy."""
    plan = unimp.get_backend("toy").compile(unimp.load("mixed_bf16"))
    m = Model()
    amp = unimp.apply(plan, m)
    assert amp.plan is plan and amp.backend == "toy"
    with pytest.raises(RuntimeError, match="already has a unimp policy applied"):
        unimp.apply(plan, m)
    amp.remove()


def test_what_a_backend_binds_itself_is_released_by_remove():
    """A backend's apply may bind more objects (a compiled wrapper's inner module, via ``amp.bind_also``);
    the registry keeps those marks and ``amp.remove()`` releases every one of them."""
    inner = Model()

    class Wrapping(ToyBackend):
        name = "wrapping"

        def apply(self, plan, model, optimizer=None, **options):
            amp = ToyAmp(plan, model, optimizer)
            amp.bind_also(inner)
            return amp

    unimp.register_backend(Wrapping)
    amp = unimp.apply("mixed_bf16", Model(), backend="wrapping")
    with pytest.raises(RuntimeError, match="already has a unimp policy applied"):
        unimp.apply("mixed_bf16", inner, backend="toy")
    amp.remove()
    unimp.apply("mixed_bf16", inner, backend="toy").remove()
