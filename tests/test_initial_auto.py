"""``loss_scale.initial = "auto"`` (the default): the scale starts where the framework's own scaler starts.

The values a backend resolves it to are checked against the framework itself in each backend's suite (Keras'
``LossScaleOptimizer``, torch's ``GradScaler``, Paddle's ``GradScaler``, Flax's ``DynamicScale``); here: the
file format, the round trips, the fingerprint, and a backend that declares its own starting scale.
"""

import json

import jsonschema
import pytest

import unimp
from unimp import Backend, PolicyError
from unimp.plan import Plan
from unimp.policy.spec import json_schema


class Starts8(Backend):
    """A backend whose framework's scaler starts at 8 (the only thing it declares)."""

    name = "starts8"
    framework = "starts8"
    distribution = "starts8"
    model_types = "nothing"

    def accepts(self, model):
        return False

    def initial_scale(self):
        return 8.0

    def plan(self, request, model=None):
        return request.compile(control={}, native={})

    def apply(self, plan, model, optimizer=None, **options):
        raise NotImplementedError


def test_auto_is_the_default_and_every_unset_preset_keeps_it():
    for name in ("mixed_fp16", "fp16_master", "mixed_bf16"):
        assert unimp.load(name).to_dict()["loss_scale"]["initial"] == "auto"
    assert unimp.load({"loss_scale": {"initial": "auto"}}) == unimp.load({})
    # presets named after a system pin that system's value
    assert unimp.load("torch_autocast_cuda").to_dict()["loss_scale"]["initial"] == 65536.0
    assert unimp.load("keras_mixed_float16").to_dict()["loss_scale"]["initial"] == 32768.0


def test_a_backend_that_declares_no_other_starts_at_2_16():
    plan = Plan.request(unimp.load("mixed_fp16"), "demo").compile(control={}, native={})
    assert plan.loss_scale.initial == 2.0 ** 16 and not plan.loss_scale.initial_auto


def test_the_backend_declared_value_is_what_the_plan_runs_and_reports():
    plan = Starts8().compile(unimp.load("mixed_fp16"))
    assert plan.loss_scale.initial == 8.0
    assert plan.to_dict()["loss_scale"]["initial"] == 8.0
    assert "dynamic from 8 (" in str(plan) and 'initial "auto"' in str(plan)
    explicit = Starts8().compile(unimp.load({"extends": "mixed_fp16", "loss_scale": {"initial": 1024.0}}))
    assert explicit.loss_scale.initial == 1024.0 and 'initial "auto"' not in str(explicit)


def test_an_auto_scale_outside_min_max_is_named_where_it_resolves():
    pol = unimp.load({"extends": "mixed_fp16", "loss_scale": {"min": 16.0}})  # fine at 2^16
    with pytest.raises(PolicyError, match=r"loss_scale\.min \(16\).*starts at on starts8 \(8\).*fix: set "
                                          r"loss_scale\.initial"):
        Starts8().compile(pol)
    with pytest.raises(PolicyError, match=r'loss_scale\.min: min \(131072\) is above initial \("auto": 65536\)'):
        unimp.load({"extends": "mixed_fp16", "loss_scale": {"min": 131072.0}})


@pytest.mark.parametrize("bad", ["Auto", "automatic", "", None, True])
def test_anything_else_than_a_number_or_auto_is_refused(bad):
    with pytest.raises(PolicyError, match=r'loss_scale\.initial: expected a number or "auto"'):
        unimp.load({"loss_scale": {"initial": bad}})


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_auto_round_trips_through_every_format(tmp_path, suffix):
    p = unimp.load({"extends": "mixed_fp16", "loss_scale": {"growth_interval": 7}})
    q = unimp.load(unimp.dump(p, tmp_path / f"p{suffix}"))
    assert q == p and q.loss_scale.initial_auto and q.fingerprint == p.fingerprint
    assert q.replace(loss_scale={"initial": 4.0}).loss_scale.initial_auto is False


def test_the_fingerprint_is_the_one_of_the_2_16_default_it_replaced():
    """State dicts saved before ``auto`` existed (every default was 2^16) keep loading strictly; a saved state
    carries its scale, so the starting point is no part of what it restores."""
    auto = unimp.load("mixed_fp16")
    pinned = unimp.load({"extends": "mixed_fp16", "loss_scale": {"initial": 65536.0}})
    assert auto.fingerprint == pinned.fingerprint and not pinned.loss_scale.initial_auto


def test_the_json_schema_takes_auto_and_numbers_only():
    validator = jsonschema.Draft202012Validator(json_schema())
    assert validator.is_valid({"loss_scale": {"initial": "auto"}})
    assert validator.is_valid(json.loads(json.dumps(unimp.load("mixed_fp16").to_dict(), default=str)))
    assert not validator.is_valid({"loss_scale": {"initial": "automatic"}})


@pytest.mark.parametrize("system", ["accelerate", "apex", "deepspeed", "flax", "jmp", "keras", "tf_keras",
                                    "lightning", "megatron", "neox", "paddle", "torch"])
def test_an_export_writes_the_scale_auto_runs_there(system):
    """``unimp export`` of a policy with ``initial = "auto"`` writes the number unimp starts at on that
    system's framework, so re-importing it reproduces the key (no "cannot express" line for it)."""
    import warnings

    from unimp import migrate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = migrate.export_to(system, "mixed_fp16")
    assert not [line for line in out.unexpressed if line.startswith("loss_scale.initial")]
