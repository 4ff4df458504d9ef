"""What the torch cells share (HF models in ``test_torch_models``, timm/torchvision in
``test_vision_models``): the hand-written torch AMP reference and one cell's checks."""

import copy
import math

import torch
from tolerance import reference_tolerance

import unimp

STEPS = 10
# preset -> torch's own AMP written by hand: the autocast dtype, or None for plain fp32
NATIVE = {"fp32": None, "torch_autocast_cpu": torch.bfloat16, "mixed_bf16": torch.bfloat16,
          "mixed_fp16": torch.float16, "pure_bf16": torch.bfloat16, "fp16_master": torch.float16}
# presets that run the very kernels of their reference: bit-identical over the whole run. The others
# differ from torch's own by design (norms, BatchNorm statistics, pools in float32), and a 10-step
# trajectory amplifies a rounding difference chaotically, by an amount that depends on the CPU, so
# each step's loss is compared with torch's own at the same weights (tests_models/tolerance.py).
EXACT = {"fp32", "torch_autocast_cpu"}
# presets with low-precision parameters: the hand-written reference holds them in that dtype (norms fp32)
LOW_PARAMS = {"pure_bf16": torch.bfloat16, "fp16_master": torch.float16}
NORMS = (torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm)
# layers torch's autocast runs in its low dtype (HF GPT-2's Conv1D is an addmm): under a low-precision
# preset their outputs must be in the compute dtype, so a policy that lowers nothing fails the cell
LOWERED = ("Linear", "Conv2d", "Conv1D")


def lower_params(model, dtype):
    """The model's parameters in ``dtype`` except the norms' (apex O2 style)."""
    keep = {id(p) for m in model.modules() if isinstance(m, NORMS) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.data = p.data.to(dtype)


def train_native(model, loss_of, dtype, steps=STEPS, lr=1e-3):
    """torch's own AMP written by hand: autocast (plain float32 for ``dtype`` None) and AdamW.
    ``loss_of(model)`` runs one forward and returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_of(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def native_loss_at(native, model, loss_of, dtype):
    """torch's own autocast loss of ``native`` holding the weights and buffers ``model`` computes
    with now (the low copies under the presets with low-precision parameters); no gradient."""
    params, buffers = dict(native.named_parameters()), dict(native.named_buffers())
    with torch.no_grad():
        for name, p in model.named_parameters():
            params[name].copy_(p)
        for name, b in model.named_buffers():
            buffers[name].copy_(b)
        with torch.autocast("cpu", dtype=dtype):
            return loss_of(native).item()


def check_training(c, preset, amp, model, native, loss_of, lr=1e-3, steps=STEPS):
    """Train the applied ``model`` ``steps`` steps and check its losses against torch's own AMP
    written by hand on ``native`` (a copy of the model taken before apply): the whole run bit for
    bit for :data:`EXACT`, else each step's loss against torch's own at the weights that step
    starts from, within ``u * sqrt(layers)`` (layers: the model's leaf modules). Returns the losses."""
    dtype, exact = NATIVE[preset], preset in EXACT
    low = LOW_PARAMS.get(preset)
    if not exact and low:
        lower_params(native, low)
    losses, want = [], []
    for _ in range(steps):
        if not exact:
            want.append(native_loss_at(native, model, loss_of, dtype))
        loss = loss_of(amp.model)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.zero_grad()
        losses.append(loss.item())
    what = "plain float32" if dtype is None else f"hand-written torch.autocast('cpu', {dtype})"
    what += f" with {low} weights (norms fp32)" if low else ""
    if exact:
        want = train_native(native, loss_of, dtype, steps, lr)
        assert losses == want, (losses, want)
        c.check("loss", f"{steps} steps, bit-identical to {what}")
        return losses
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses  # it trains
    layers = sum(1 for m in model.modules() if next(m.children(), None) is None)
    tol = reference_tolerance(str(dtype).replace("torch.", ""), layers)
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    assert rel <= tol, (rel, tol, losses, want)
    c.check("loss", f"{steps} steps; each step's loss vs {what} at the same weights: max rel diff {rel:.1e} "
                    f"(tolerance u*sqrt({layers} layers) = {tol:.1e})")
    return losses


def check_remove(c, model, preset, forward, **apply_kw):
    """apply, one forward, remove(): state_dict values and strides and the outputs bit for bit
    (in eval mode: a training forward updates BatchNorm's running statistics)."""
    training = model.training
    model.eval()
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        before = forward(model)
    amp = unimp.apply(preset, model, **apply_kw)
    with torch.no_grad():
        forward(amp.model)
    amp.remove()
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) and v.stride() == after[k].stride() for k, v in state.items())
    with torch.no_grad():
        assert torch.equal(before, forward(model))
    model.train(training)
    c.check("remove", "untouched model bit for bit (state_dict values and strides, outputs)")


def check_report(c, amp, model, forward, preset):
    """Report rows vs the output dtypes that forward hooks registered here see; the :data:`LOWERED`
    layers' outputs in the preset's compute dtype (:data:`NATIVE`'s, float32 for fp32)."""
    report = amp.report()
    seen = {}

    def hook(path):
        def record(module, args, out):
            seen.setdefault(path, out.dtype if torch.is_tensor(out) else None)
        return record

    hooks = [m.register_forward_hook(hook(p)) for p, m in model.named_modules() if p and not list(m.children())]
    with torch.no_grad():
        forward(amp.model)
    for h in hooks:
        h.remove()
    rows = [r for r in report.rows if seen.get(r.path) is not None and r.output_dtype]
    assert rows and all(r.output_dtype == str(seen[r.path]).replace("torch.", "") for r in rows), \
        [(r.path, r.output_dtype, seen[r.path]) for r in rows]
    dtype = NATIVE[preset] or torch.float32
    lowered = {p: seen[p] for p, m in model.named_modules() if type(m).__name__ in LOWERED and p in seen}
    assert lowered and set(lowered.values()) == {dtype}, lowered
    c.check("report", f"{len(rows)} rows = output dtypes seen by forward hooks; the {len(lowered)} "
                      f"{'/'.join(LOWERED)} layers output {dtype}")
