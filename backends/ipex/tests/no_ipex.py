"""Run as a script: a torch process where IPEX cannot be imported (as if not installed).

Prints JSON: the chosen engine and why, whether IPEX got imported, LayerNorm grads of stock torch.
"""

import json
import sys

sys.modules["intel_extension_for_pytorch"] = None  # import fails: the not-installed path

import torch  # noqa: E402

import unimp  # noqa: E402
from unimp_ipex import engine  # noqa: E402

engine.importlib.util.find_spec = lambda name, _find=engine.importlib.util.find_spec: (
    None if name == "intel_extension_for_pytorch" else _find(name))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
state = {k: v.tolist() for k, v in model.state_dict().items()}
amp = unimp.apply("mixed_bf16", model, torch.optim.SGD(model.parameters(), lr=0.1))
x = torch.linspace(-2, 2, 64).reshape(4, 16)
amp.backward(amp.model(x).square().mean())
grads = {n: p.grad.tolist() for n, p in model.named_parameters()}
print(json.dumps({"backend": amp.backend, "engine": amp.plan.details.engine,
                  "reason": amp.plan.details.engine_reason,
                  "ipex": amp.plan.details.ipex and vars(amp.plan.details.ipex),
                  "notes": list(amp.plan.notes), "imported": "intel_extension_for_pytorch" in sys.modules
                  and sys.modules["intel_extension_for_pytorch"] is not None,
                  "state": state, "grads": grads}))
