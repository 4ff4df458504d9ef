"""A loss computed outside the policy in low precision is pointed out at ``amp.backward`` (once).

Under ``output_dtype = "unchanged"`` (mixed_bf16) the model returns what its last op computed, as
``torch.autocast`` does: a loss written on those outputs outside the model runs in bfloat16, as it
would outside a native autocast region, while the policy lists ``loss`` as float32.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

import unimp


def _amp(policy: str = "mixed_bf16") -> unimp.Amp:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return unimp.apply(policy, m, torch.optim.SGD(m.parameters(), lr=0.1))


def _loss_warnings(amp: unimp.Amp, loss_of) -> list[str]:
    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            amp.backward(loss_of(amp.model(x), y))
    return [str(w.message) for w in caught if "the loss reached the Amp" in str(w.message)]


def test_a_bfloat16_loss_outside_the_policy_warns_once_with_the_fix():
    amp = _amp()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # native: the same model's logits are bf16
        native = amp.model(torch.randn(4, 8))
    assert native.dtype == torch.bfloat16 and F.cross_entropy(native, torch.zeros(4, dtype=torch.long)).dtype \
        == torch.bfloat16  # a loss written on them outside autocast runs in bf16
    found = _loss_warnings(amp, F.cross_entropy)
    assert len(found) == 1 and "bfloat16" in found[0] and ".float()" in found[0]


def test_a_float32_loss_or_a_policy_without_a_float32_loss_is_silent():
    assert _loss_warnings(_amp(), lambda out, y: F.cross_entropy(out.float(), y)) == []
    fp32_out = unimp.load("mixed_bf16").replace(output_dtype="float32")
    assert _loss_warnings(_amp(fp32_out), F.cross_entropy) == []
