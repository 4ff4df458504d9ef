"""timm (ViT, ResNet) and torchvision ResNet under the torch presets (tiny configs, random init, CPU).

Runs in the ``ipex`` tox env (the one with torch 2.8): torch 2.8 with its torchvision 0.23 and timm (PyPI's only
torchvision for torch 2.13 is the CUDA build, which breaks CPU torch 2.13 and ``import transformers``).
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch_cells import LOW_PARAMS, NATIVE, check_remove, check_report, check_training

import unimp

timm = pytest.importorskip("timm")
torchvision = pytest.importorskip("torchvision")

G = torch.Generator().manual_seed(0)
X = torch.randn(4, 3, 16, 16, generator=G)
Y = torch.randint(0, 10, (4,), generator=G)
# the ResNets downsample 32x: at 64x64 their smallest feature map is 2x2. On a 1x1 map a 3x3 conv's
# bfloat16 weight gradient from torch 2.8's CPU kernels (oneDNN) holds uninitialised memory in the
# taps that only see padding (garbage, at times NaN, under plain torch.autocast too), which made
# these cells fail at random in full runs (test_no_conv_sees_a_1x1_map keeps the inputs large enough)
X64 = torch.randn(4, 3, 64, 64, generator=G)
LR = 1e-4  # ResNets memorise 4 images in 10 steps at 1e-3 (losses near 0: relative diffs meaningless)


def timm_vit():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=16, patch_size=4,
                             embed_dim=32, depth=2, num_heads=2)


def timm_resnet():
    return timm.create_model("resnet10t", pretrained=False, num_classes=10)


def torchvision_resnet():
    return torchvision.models.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=10)


MODELS = {"timm_vit": timm_vit, "timm_resnet": timm_resnet, "torchvision_resnet": torchvision_resnet}
INPUTS = {"timm_vit": X, "timm_resnet": X64, "torchvision_resnet": X64}


def forward(x):
    return lambda model: model(x)


def loss_of(x):
    return lambda model: F.cross_entropy(model(x).float(), Y)


@pytest.mark.parametrize("preset", list(NATIVE))
@pytest.mark.parametrize("name", list(MODELS))
def test_vision_model(name, preset, cell):
    c = cell("torch-vision", name, preset)
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    forward_x, loss_x = forward(INPUTS[name]), loss_of(INPUTS[name])
    check_remove(c, model, preset, forward_x, backend="torch")

    native = copy.deepcopy(model)
    amp = unimp.apply(preset, model, torch.optim.AdamW(model.parameters(), LR), backend="torch")
    check_training(c, preset, amp, model, native, loss_x, LR)
    check_report(c, amp, model, forward_x, preset)

    # torch.save(model.state_dict()) while applied -> a fresh model loads the fp32 weights of
    # the model after remove() (the masters, for presets with low-precision parameters)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    amp.remove()
    fresh = MODELS[name]()
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    mine = model.state_dict()
    differ = [k for k, v in fresh.state_dict().items() if v.dtype != mine[k].dtype or not torch.equal(v, mine[k])]
    assert not differ, [(k, mine[k].dtype, mine[k].isfinite().all().item()) for k in differ]
    c.check("save/load", "torch.save(state_dict) while applied -> load_state_dict = the model after remove()"
            + (" (the fp32 masters)" if preset in LOW_PARAMS else ""))


@pytest.mark.parametrize("name", ["timm_resnet", "torchvision_resnet"])
def test_no_conv_sees_a_1x1_map(name):
    """Every conv with a kernel wider than 1 sees at least a 2x2 input (see X64)."""
    model = MODELS[name]()
    small = []

    def check(module, args):
        if max(module.kernel_size) > 1 and min(args[0].shape[-2:]) < 2:
            small.append((module, tuple(args[0].shape)))

    hooks = [m.register_forward_pre_hook(check) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(INPUTS[name])
    for h in hooks:
        h.remove()
    assert hooks and not small, small
