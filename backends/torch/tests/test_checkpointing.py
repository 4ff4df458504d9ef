"""Gradient checkpointing recomputes under unimp's op rules: gradients equal the same model without
checkpointing bit for bit (torch.utils.checkpoint in both modes, HF gradient_checkpointing_enable)."""

import copy

import pytest
import torch
from models import Block
from torch import nn
from torch.utils.checkpoint import checkpoint

import unimp

BF16 = torch.bfloat16
# mixed_bf16 moves ops through unimp's Autocast kernels; the custom list (a float32 linear, which has
# a C++ Autocast kernel) through the eager TorchFunctionMode
CUSTOM = {"extends": "mixed_bf16", "ops": {"lower": ["softmax"], "float32": ["matmul", "linear"]}}
POLICIES = ["mixed_bf16", CUSTOM]
MODES = [pytest.param(False, id="non_reentrant"), pytest.param(True, id="reentrant")]


class Stack(nn.Module):
    """An embedding, two :class:`Block` s (each checkpointed when ``reentrant`` is not None), a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 8)
        self.reentrant: bool | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h) if self.reentrant is None else checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def grads(model: nn.Module, forward, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    forward(x).float().square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert torch.equal(a[name], b[name]), name


def unimp_grads(policy, reentrant: bool | None) -> dict:
    model = Stack()
    model.reentrant = reentrant
    amp = unimp.apply(copy.deepcopy(policy), model)
    try:
        return grads(model, amp.model, torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1)))
    finally:
        amp.remove()


@pytest.mark.parametrize("reentrant", MODES)
def test_native_autocast_checkpointing_is_exact(reentrant):
    # the control: torch's own autocast recomputes the same ops in the same dtypes
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))

    def native(model):
        def run(x):
            with torch.autocast("cpu", dtype=BF16):
                return model(x)
        return grads(model, run, x)

    plain, ckpt = Stack(), Stack()
    ckpt.reentrant = reentrant
    assert_same(native(plain), native(ckpt))


@pytest.mark.parametrize("reentrant", MODES)
@pytest.mark.parametrize("policy", POLICIES, ids=["mixed_bf16", "custom_list"])
def test_checkpointed_gradients_equal_uncheckpointed(policy, reentrant):
    assert_same(unimp_grads(policy, None), unimp_grads(policy, reentrant))


def test_checkpoint_outside_a_unimp_forward_is_torch_own():
    import torch.utils.checkpoint as ckpt

    own = (ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator)
    unimp_grads("mixed_bf16", False)
    assert (ckpt.CheckpointFunction, ckpt._checkpoint_without_reentrant_generator) == own


@pytest.mark.parametrize("reentrant", MODES)
def test_hf_gpt2_gradient_checkpointing(reentrant):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))

    def run(checkpointing: bool) -> dict:
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="eager").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        amp = unimp.apply("mixed_bf16", model)
        try:
            model.zero_grad()
            amp.model(input_ids=ids, labels=ids).loss.backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        finally:
            amp.remove()

    assert_same(run(False), run(True))
