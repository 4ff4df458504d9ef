"""Train a small Paddle model under the team's shared unimp policy (the training loop of docs/design.md).

    python examples/paddle_train.py [policy.toml]

Uses examples/team_policy.toml when present (else the mixed_bf16 preset). Paddle's dygraph AMP
runs on CUDA only; on CPU the policy is applied with on_unsupported = "fallback" and the Plan shows,
per op, that Paddle runs it in float32 and why.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")
warnings.filterwarnings("ignore", message="amp_guard can only be enabled")

import numpy as np  # noqa: E402
import paddle  # noqa: E402

import unimp  # noqa: E402

HERE = Path(__file__).resolve().parent


def main(path: str | None = None) -> None:
    team = HERE / "team_policy.toml"
    policy = unimp.load(path or (str(team) if team.exists() else "mixed_bf16"))
    if not paddle.device.get_device().startswith("gpu"):
        policy = policy.replace(on_unsupported="fallback")
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(64, 128), paddle.nn.ReLU(), paddle.nn.LayerNorm(128),
                                 paddle.nn.Linear(128, 8))
    optimizer = paddle.optimizer.Adam(learning_rate=1e-2, parameters=model.parameters())
    amp = unimp.apply(policy, model, optimizer)
    print(amp.plan)
    rng = np.random.default_rng(0)
    x = paddle.to_tensor(rng.normal(size=(256, 64)).astype("float32"))
    y = paddle.to_tensor((rng.normal(size=(256, 1)) > 0).astype("int64") * 3)
    for step in range(20):
        loss = paddle.nn.functional.cross_entropy(amp.model(x).astype("float32"), y)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.clear_grad()
        if step % 5 == 0:
            print(f"step {step:2d} loss {float(loss):.4f} scale {amp.scale:g} skipped {amp.skipped_steps}")
    print(amp.report(x))
    print("state_dict:", amp.state_dict())
    amp.remove()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
