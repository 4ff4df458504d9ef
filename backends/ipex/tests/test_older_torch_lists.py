"""unimp_torch's op lists on the older torch this env pins (2.8, for IPEX): the CUDA lists of that torch
have no Autocast kernel for ``rms_norm`` (torch 2.13 added it), which must not turn the plain-autocast
preset into a policy that also moves ``mean`` (found on an H200 with torch 2.11). The plans are built for
``cuda`` from torch's dispatcher tables, which a CPU machine has too."""

import pytest
import torch

import unimp
from unimp.spi import Plan
from unimp_torch.autocast import has_kernel, is_torch_own
from unimp_torch.plan import compile_plan

pytestmark = pytest.mark.skipif(has_kernel("rms_norm", "cuda"),
                                reason=f"torch {torch.__version__} has a CUDA Autocast kernel for rms_norm")


def test_torch_autocast_cuda_on_a_torch_without_the_rms_norm_kernel_is_still_torchs_own_lists():
    request = Plan.request(unimp.load("torch_autocast_cuda"), "torch")
    assert not has_kernel("mean", "cuda")  # torch's CUDA autocast: mean follows its input
    assert is_torch_own(request, "cuda")
    # only the op this torch lacks is moved; mean keeps torch's choice
    assert compile_plan(request, device="cuda").details.op_moves == {"rms_norm": "float32"}


@pytest.mark.parametrize("preset", ["mixed_bf16", "mixed_fp16"])
def test_mixed_presets_still_move_mean_on_cuda(preset):
    request = Plan.request(unimp.load(preset), "torch")
    assert not is_torch_own(request, "cuda")
    moves = compile_plan(request, device="cuda").details.op_moves
    assert moves.get("mean") == "float32" and moves.get("rms_norm") == "float32"
