"""What the torch cells share (HF models in ``test_torch_models``, timm/torchvision in
``test_vision_models``): the hand-written torch AMP reference and one cell's checks."""

import copy

import torch

import unimp

STEPS = 10
# preset -> (hand-written torch AMP: autocast dtype or None for plain fp32; relative loss tolerance; 0 = bit-identical)
NATIVE = {"fp32": (None, 0.0), "torch_autocast_cpu": (torch.bfloat16, 0.0), "mixed_bf16": (torch.bfloat16, 2e-2),
          "mixed_fp16": (torch.float16, 1e-3), "pure_bf16": (torch.bfloat16, 1e-3),
          "fp16_master": (torch.float16, 1e-3)}
# presets with low-precision parameters: the hand-written reference keeps fp32 masters by hand
LOW_PARAMS = {"pure_bf16": torch.bfloat16, "fp16_master": torch.float16}
NORMS = (torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm, torch.nn.GroupNorm)


def train_native(model, loss_of, dtype, params=None, steps=STEPS, lr=1e-3):
    """torch's own AMP written by hand: autocast, and a GradScaler for float16. With ``params``
    (a low dtype): the model's parameters in that dtype except the norms', and fp32 master copies
    that the optimizer steps (apex O2 style: grads copied onto the masters, the masters copied
    back). ``loss_of(model)`` runs one forward and returns the loss."""
    unique = list({id(p): p for p in model.parameters()}.values())
    masters = unique
    if params is not None:
        masters = [torch.nn.Parameter(p.detach().clone()) for p in unique]
        keep = {id(p) for m in model.modules() if isinstance(m, NORMS) for p in m.parameters()}
        for p in unique:
            if id(p) not in keep:
                p.data = p.data.to(params)
    opt = torch.optim.AdamW(masters, lr)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_of(model)
        scaler.scale(loss).backward()
        if params is not None:
            for p, m in zip(unique, masters):
                m.grad = p.grad.float()
                p.grad = None
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if params is not None:
            with torch.no_grad():
                for p, m in zip(unique, masters):
                    p.copy_(m)
        losses.append(loss.item())
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


def check_loss(c, preset, losses, native, loss_of, lr=1e-3, tolerances=None, of_first=False):
    """The applied model's losses vs the hand-written reference on ``native`` (a copy of the model);
    ``tolerances`` (preset -> relative tolerance) replace :data:`NATIVE`'s for a family of models.
    ``of_first``: each step's difference is taken relative to the reference's first loss instead of
    that step's (for models that drive the loss near 0 within the steps, where per-step relative
    differences of the mixed presets say nothing). Tolerance 0 is bit-identity either way."""
    dtype, tol = NATIVE[preset]
    tol = (tolerances or {}).get(preset, tol)
    low = LOW_PARAMS.get(preset)
    want = train_native(native, loss_of, dtype, low, len(losses), lr)
    what = "plain float32" if dtype is None else f"hand-written torch.autocast('cpu', {dtype})"
    what += " + GradScaler" if dtype == torch.float16 else ""
    what += f" with {low} weights (norms fp32) and fp32 masters by hand" if low else ""
    if tol == 0.0:
        assert losses == want, (losses, want)
        c.check("loss", f"{len(losses)} steps, bit-identical to {what}")
    else:
        rel = max(abs(a - b) / abs(want[0] if of_first else b) for a, b in zip(losses, want))
        assert rel <= tol, (losses, want)
        if of_first:
            what += f" (loss {want[0]:.3g} -> {want[-1]:.3g}); diffs relative to the first loss"
        c.check("loss", f"{len(losses)} steps vs {what}: max rel diff {rel:.1e} (tolerance {tol:g})")


def check_report(c, amp, model, forward):
    """Report rows vs the output dtypes that forward hooks registered here see."""
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
    c.check("report", f"{len(rows)} rows = output dtypes seen by forward hooks")
