"""The installed forward keeps the model's signature (HF Trainer's remove_unused_columns reads it)."""

import inspect

import torch
from torch import nn

import unimp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.fc(input_ids)


def test_patched_forward_keeps_signature():
    model = Net()
    want = inspect.signature(model.forward)
    amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), 0.1))
    amp.model(torch.ones(2, 4))  # past the one-time observing forward (amp.py), the installed forward
    assert inspect.signature(amp.model.forward) == want
    assert list(inspect.signature(amp.model.forward).parameters) == ["input_ids", "attention_mask", "labels"]
    amp.remove()
