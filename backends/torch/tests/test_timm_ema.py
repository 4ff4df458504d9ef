"""timm's EMA (``timm.utils.ModelEmaV3``, the one timm's ``train.py`` keeps) over a timm ViT under a policy with
fp32 masters: the EMA is of the masters, kept in float32, as an fp32 training run's EMA.

timm needs torchvision: only the ``ipex`` tox env (torch 2.8, torchvision 0.23, timm) has both, and runs this
file (tox.ini); elsewhere it is skipped (PyPI's torchvision for the torch env's torch is a CUDA build).
"""

import pytest
import torch
from models import train_steps
from torch import nn

import unimp

timm = pytest.importorskip("timm", reason="timm needs torchvision, which only the ipex tox env has (tox.ini)")
from timm.utils import ModelEmaV3  # noqa: E402

EMBED, MLP = 32, 4 * 32  # the ViT's width and its MLP's hidden width (the longest reduction)
LR, STEPS, DECAY = 0.01, 4, 0.9  # small steps (a few 1e-3 of the weights): where rounded weights would show
U = {"fp16_master": 2.0 ** -11, "pure_bf16": 2.0 ** -8}  # the low dtype's unit roundoff
# fp16_master's loss scale from 2^10: at the default 2^16 the first step overflows and is skipped (the EMA of a
# run one step shorter than the fp32 one)
POLICIES = {"fp16_master": {"extends": "fp16_master", "loss_scale": {"initial": 2.0 ** 10}}, "pure_bf16": "pure_bf16"}


def vit() -> nn.Module:
    """timm's ViT-Tiny from its config, scaled down (random init, no download)."""
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=4, img_size=16, patch_size=4,
                             embed_dim=EMBED, depth=2, num_heads=2)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float(), y)


def tolerance(preset: str) -> float:
    """Higham's gamma_K ~ K u for the longest dot product (the MLP's hidden width), plus one rounding of the
    stored low-precision weights and one of the output (as test_compositions.update_tolerance)."""
    return (MLP + 2) * U[preset]


def moved(ema: ModelEmaV3, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The EMA's parameters minus the initial weights (float64)."""
    return {n: p.detach().double() - start[n].double() for n, p in ema.module.named_parameters()}


def rel_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    return {n: float((got[n] - want[n]).norm() / want[n].norm()) for n in want if want[n].norm() > 0}


@pytest.mark.parametrize("built", ["after_apply", "before_apply"])
@pytest.mark.parametrize("preset", ["fp16_master", "pure_bf16"])
def test_timm_model_ema_v3_averages_the_fp32_masters_like_fp32(preset, built):
    """``ModelEmaV3(model)`` built after ``unimp.apply`` (timm's train.py order) or before it, ``ema.update(model)``
    each step: the EMA's parameters are float32 and their move from the initial weights equals an fp32 run's
    ModelEmaV3 within the dtype's bound, which an EMA of the low-precision copies (beside it) misses."""
    data = batches()
    reference = vit()
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ema_ref = ModelEmaV3(reference, decay=DECAY)
    train_steps(reference, torch.optim.SGD(reference.parameters(), lr=LR), data, loss_fn,
                after=lambda: ema_ref.update(reference))

    model = vit()
    ema = ModelEmaV3(model, decay=DECAY) if built == "before_apply" else None
    amp = unimp.apply(POLICIES[preset], model, torch.optim.SGD(model.parameters(), lr=LR), backend="torch")
    if ema is None:
        ema = ModelEmaV3(model, decay=DECAY)
    lows = {n: low for n, low, _ in amp.master_weights}
    shadow = vit()  # an fp32 model given the low-precision copies: the EMA of what they hold

    @torch.no_grad()
    def give_lows() -> None:
        for n, p in shadow.named_parameters():
            if n in lows:
                p.copy_(lows[n])

    give_lows()
    rounded = ModelEmaV3(shadow, decay=DECAY)

    def update_both() -> None:
        ema.update(model)
        give_lows()
        rounded.update(shadow)

    train_steps(model, amp.optimizer, data, loss_fn, amp, after=update_both)
    assert lows
    assert all(p.dtype == torch.float32 for p in ema.module.parameters())  # the EMA is kept in float32
    assert next(iter(lows.values())).dtype != torch.float32  # the model computes with low-precision copies
    expected = moved(ema_ref, start)
    errors = rel_errors(moved(ema, start), expected)
    assert max(errors.values()) < tolerance(preset), errors
    rounding = rel_errors(moved(rounded, start), expected)
    assert max(rounding.values()) > tolerance(preset), rounding  # the same check fails the EMA of the copies
    assert amp.skipped_steps == 0  # every step counted, as in the fp32 run
    if built == "after_apply":
        x = data[0][0]
        assert ema.module(x).dtype == model(x).dtype  # the EMA copy of the applied model runs under the policy
    amp.remove()
