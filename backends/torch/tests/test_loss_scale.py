"""Loss scaling = the core reference, for every knob; torch's real GradScaler = the torch preset."""

import pathlib
import random
import sys

import pytest
import torch
from models import mlp

import unimp
from unimp.conformance.loss_scale import Replay, check_loss_scale_replay, check_system_replay, reference
from unimp.loss_scale import LossScale, LossScaleAtMinimumError
from unimp_torch.scaler import DeviceLossScale

PRESETS = ["mixed_fp16", "torch_autocast_cuda", "deepspeed_fp16", "megatron_fp16", "flax_dynamic_scale",
           "keras_mixed_float16", "jmp_float16", "paddle_o1", "apex_o1"]


def _sequence(seed, n=120, p_bad=0.3):
    rng = random.Random(seed)
    return [rng.random() > p_bad for _ in range(n)]


def _device_runner(spec, seqs):
    """unimp_torch's DeviceLossScale (fused kernel or the core rule through TorchOps), per sequence."""
    out = []
    for seq in seqs:
        dev, scales, skips, error_at = DeviceLossScale(spec, "cpu"), [], [], None
        for i, finite in enumerate(seq):
            before = int(dev.skipped)
            try:
                dev.update(torch.tensor(0.0 if finite else 1.0))
            except LossScaleAtMinimumError:
                error_at = i
                break
            scales.append(dev.scale.item())
            skips.append(int(dev.skipped) > before)
        out.append(Replay(scales, skips, error_at, None if error_at is not None else dev.state()))
    return out


def _gradscaler(spec, seq):
    """torch.amp.GradScaler's own update() (its fused CPU kernel), fed each step's found_inf the
    way its unscale_ records it (an unscale_ would see inf grads once the scale underflows to 0)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=spec.initial, growth_factor=spec.growth_factor,
                                  backoff_factor=spec.backoff_factor, growth_interval=spec.growth_interval)
    scaler.scale(torch.ones(()))  # allocates its scale and growth tracker
    opt = object()
    scales, skips = [], []
    for f in seq:
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {
            torch.device("cpu"): torch.tensor([0.0 if f else 1.0])}
        skips.append(sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0)  # step() skips then
        scaler.update()
        scales.append(scaler.get_scale())
    return Replay(scales, skips)


def test_real_gradscaler_replays_the_torch_preset_and_the_device_rule():
    """torch.amp.GradScaler = the torch_autocast_cuda reference = unimp_torch's DeviceLossScale, on the
    system replay sequences (the subnormal range and 0 included: the preset's floor is 0)."""
    spec = unimp.load("torch_autocast_cuda").loss_scale
    n = check_system_replay(_gradscaler, spec, backend=_device_runner)
    assert n >= 16


@pytest.mark.parametrize("preset", ["deepspeed_fp16", "deepspeed_zero_fp16", "megatron_fp16", "apex_o1"])
def test_device_rule_replays_the_other_torch_systems(preset):
    """DeviceLossScale on the system sequences of the DeepSpeed, Megatron and apex presets (the
    reference = those systems: tests/test_loss_scale_systems.py); float64 scales held on the device."""
    spec = unimp.load(preset).loss_scale
    check_system_replay(lambda s, seq: reference(s, seq), spec, backend=_device_runner)
    if spec.scale_dtype == "float64":
        assert DeviceLossScale(spec, "cpu").scale.dtype == torch.float64


def test_real_deepspeed_scalers_replay_their_presets():
    """Where DeepSpeed imports (not in the tox matrix: see tests/fixtures/make_loss_scale_systems.py)."""
    pytest.importorskip("deepspeed")
    sys.path.insert(0, str(pathlib.Path(__file__).parents[3] / "tests" / "fixtures"))
    import importlib.util

    from make_loss_scale_systems import SYSTEMS, init

    init()
    for preset, native in SYSTEMS.items():
        if preset.startswith("megatron") and importlib.util.find_spec("megatron") is None:
            continue  # the torch env installs deepspeed, not megatron-core (CUDA-only scaler)
        check_system_replay(native, unimp.load(preset).loss_scale, backend=_device_runner)


def test_device_rule_replays_the_reference_for_every_knob():
    """The conformance replay: every knob (float64 scales and subnormals included: torch holds both)."""
    assert check_loss_scale_replay(_device_runner, n_sequences=4, max_len=160) >= 4 * 24


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_replay_through_training(preset):
    """Real steps with real non-finite gradients: scale and skips = the reference at every step."""
    policy = unimp.load(preset).replace(compute_dtype="float32", param_dtype="float32",
                                        loss_scale={"growth_interval": 2})
    if policy.loss_scale.at_min == "error":
        policy = policy.replace(loss_scale={"at_min": "clamp"})
    model = mlp()
    amp = unimp.apply(policy, model, torch.optim.Adam(model.parameters(), lr=1e-3))
    rule = LossScale(policy.loss_scale)
    state = rule.initial_state()
    x = torch.randn(4, 16)
    for finite in _sequence(1, n=30, p_bad=0.35):
        loss = amp.model(x).square().mean()
        amp.backward(loss if finite else loss * float("inf"))
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        state = rule.update(state, finite).state
        assert (amp.scale, amp.skipped_steps) == (state.scale, state.skipped)
    amp.remove()


def test_real_gradscaler_matches_torch_preset_and_unimp():
    """torch.amp.GradScaler (CPU) vs the torch_autocast_cuda reference vs unimp: same scales, same params."""
    policy = unimp.load("torch_autocast_cuda").replace(compute_dtype="float32", loss_scale={"growth_interval": 3})
    ref_model, our_model = mlp(), mlp()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=65536.0, growth_interval=3)
    amp = unimp.apply(policy, our_model, torch.optim.SGD(our_model.parameters(), lr=0.05, momentum=0.9))
    rule, state = LossScale(policy.loss_scale), LossScale(policy.loss_scale).initial_state()
    for seed in range(3):
        for finite in _sequence(seed, n=40):
            x = torch.randn(4, 16)
            poison = 1.0 if finite else float("inf")
            loss = ref_model(x).square().mean() * poison
            scaler.scale(loss).backward()
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
            amp.backward(amp.model(x).square().mean() * poison)
            amp.optimizer.step()
            amp.optimizer.zero_grad()
            state = rule.update(state, finite).state
            assert scaler.get_scale() == state.scale == amp.scale
    for a, b in zip(ref_model.parameters(), our_model.parameters()):
        assert torch.equal(a, b)
    amp.remove()


@pytest.mark.parametrize("preset", ["mixed_fp16", "fp16_master"])
def test_the_generic_fp16_presets_start_where_gradscaler_starts(preset):
    """``loss_scale.initial = "auto"`` (their default) on torch: torch's own ``GradScaler()`` is the oracle."""
    model = mlp()
    amp = unimp.apply(preset, model, torch.optim.SGD(model.parameters(), 0.1))
    assert amp.scale == amp.plan.loss_scale.initial == torch.amp.GradScaler("cpu").get_scale()
    amp.remove()


def test_unimp_diff_shows_auto_and_a_pinned_2_16_run_alike_on_torch(tmp_path, capsys):
    from unimp.cli import main

    pinned = tmp_path / "pinned.toml"
    pinned.write_text('name = "pinned"\nextends = "mixed_fp16"\n[loss_scale]\ninitial = 65536.0\n')
    assert main(["diff", "mixed_fp16", str(pinned), "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert 'loss_scale.initial  "auto"' in out and "backend torch: 0 differences in what runs" in out
