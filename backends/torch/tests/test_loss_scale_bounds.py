"""Loss scaling at its bounds on the torch backend (issue 27 item 8, issue 24): a state dict with every
counter at the int32 bound loads and steps as the reference does (expected values from
:class:`unimp.LossScale`), a subnormal initial scale runs as torch's own GradScaler runs it, and
torch's GradScaler at the same bound is run side by side."""

import pytest
import torch

import unimp
from unimp.conformance.state_dicts import check_counters_at_bound
from unimp.loss_scale import LossScale, LossScaleState
from unimp.policy.spec import INT32_MAX
from unimp_torch.scaler import DeviceLossScale


def _apply(policy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    return unimp.apply(policy, model, torch.optim.SGD(model.parameters(), lr=0.1))


def _step(amp, finite=True):
    x = torch.randn(4, 8) * (1.0 if finite else float("inf"))
    amp.backward(amp.model(x).float().sum())
    amp.optimizer.step()
    amp.optimizer.zero_grad()


@pytest.mark.parametrize("policy", ["torch_autocast_cuda", "mixed_fp16", "deepspeed_fp16", "flax_dynamic_scale"])
@pytest.mark.parametrize("finite", [True, False])
def test_counters_at_the_int32_bound_step_as_the_reference(policy, finite):
    """torch_autocast_cuda runs torch's fused kernel, which grows at tracker + 1 == interval in int32:
    from a tracker at the bound the backend runs the core rule instead (tracker + 1 >= interval)."""
    amp = _apply(policy)
    st = check_counters_at_bound(amp, _step, finite)
    assert (st.steps, st.skipped) == (INT32_MAX, INT32_MAX)
    if finite and amp.plan.loss_scale.growth_schedule == "interval":
        assert st.scale == 2048.0 and st.growth_tracker == 0  # loaded at 1024 (check_counters_at_bound): it grows
    amp.remove()


def test_gradscaler_at_the_bound_it_can_reach_and_past_it():
    """torch.amp.GradScaler keeps _growth_tracker in int32 and grows at tracker + 1 == growth_interval
    (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp, _amp_update_scale_cpu_): from the largest
    tracker it produces itself (interval - 1, interval 2**31 - 1) it grows, and so does unimp; from
    2**31 - 1 (a state only a checkpoint can hold) torch wraps to -2**31 and keeps its scale: unimp
    refuses to load that state (a tracker past what the rule reaches, issue 32)."""
    spec = unimp.load("torch_autocast_cuda").replace(loss_scale={"growth_interval": INT32_MAX}).loss_scale
    for tracker, torch_grows in ((INT32_MAX - 1, True), (INT32_MAX, False)):
        scaler = torch.amp.GradScaler("cpu", growth_interval=INT32_MAX)
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": tracker, "scale": 65536.0})
        scaler.scale(torch.ones(()))
        opt = object()
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {torch.device("cpu"): torch.tensor([0.0])}
        scaler.update()
        assert (scaler.get_scale() == 131072.0) == torch_grows
        if not torch_grows:
            assert scaler._growth_tracker.item() == -(2**31)
        amp = _apply(unimp.load("torch_autocast_cuda").replace(loss_scale={"growth_interval": INT32_MAX}))
        if not torch_grows:
            with pytest.raises(unimp.StateError, match=f"growth_tracker: {tracker} is out of range 0 to {tracker - 1}"):
                amp.load_state_dict({**amp.state_dict(), "growth_tracker": tracker})
            amp.remove()
            continue
        amp.load_state_dict({**amp.state_dict(), "growth_tracker": tracker})
        _step(amp)
        want = LossScale(spec).update(LossScaleState(65536.0, tracker, 1, 0, 0), True).state
        assert amp.scale == want.scale == 131072.0 and amp.loss_scale_state().growth_tracker == 0
        amp.remove()


def test_a_subnormal_initial_scale_runs_as_gradscaler_runs_it():
    """GradScaler("cpu", init_scale=2**-140) runs (torch keeps float32 subnormals): the policy with the
    same value is accepted, and torch's own update (its fused kernel), the reference and unimp_torch's
    device scaler give the same scales on the same found-inf flags, into and out of the subnormal range."""
    policy = unimp.load("torch_autocast_cuda").replace(loss_scale={"initial": 2.0 ** -140, "growth_interval": 1})
    flags = [True, True, False, False, False, True, False, False, False, False, False, True]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** -140, growth_interval=1)
    scaler.scale(torch.ones(()))
    opt, torch_scales = object(), []
    for f in flags:
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {
            torch.device("cpu"): torch.tensor([0.0 if f else 1.0])}
        scaler.update()
        torch_scales.append(scaler.get_scale())
    ref = [o.scale for o in LossScale(policy.loss_scale).replay(flags)]
    device = DeviceLossScale(policy.loss_scale, "cpu")
    ours = []
    for f in flags:
        device.update(torch.tensor(0.0 if f else 1.0))
        ours.append(device.state().scale)
    assert torch_scales == ref == ours
    assert min(ref) < 2.0 ** -140 < max(ref)
    amp = _apply(policy)  # and a real training step runs under it
    _step(amp)
    assert amp.loss_scale_state().steps == 1
    amp.remove()
