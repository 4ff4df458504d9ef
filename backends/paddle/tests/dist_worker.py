"""One rank of the 2-process tests in test_distributed.py (run by ``paddle.distributed.launch``).

``python -m paddle.distributed.launch --nproc_per_node 2 dist_worker.py OUT_DIR`` writes
``OUT_DIR/probe.<rank>.json`` (the raw gloo collective works) and ``OUT_DIR/rank<rank>.npz``.
The model, data and policies are defined here so that the single-process reference in the test
builds exactly the same ones.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np

os.environ.setdefault("GLOG_minloglevel", "2")
warnings.filterwarnings("ignore")

GLOBAL_BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 8, 6, 16, 3, 6
INJECT = (1, 4)  # steps at which rank 1 (only) gets an inf gradient, after the all-reduce
SCALED = {"name": "dist-dynamic", "extends": "fp32",
          "loss_scale": {"mode": "dynamic", "initial": 1024.0, "growth_interval": 2, "skip_nonfinite": True}}
BF16_REDUCE = {"name": "dist-bf16-reduce", "extends": "fp32", "distributed": {"reduce_dtype": "bfloat16"}}


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"w1": rng.normal(0, 0.5, (FEATURES, HIDDEN)).astype("float32"),
            "b1": rng.normal(0, 0.1, (HIDDEN,)).astype("float32"),
            "w2": rng.normal(0, 0.5, (HIDDEN, CLASSES)).astype("float32"),
            "b2": np.zeros((CLASSES,), "float32")}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return (rng.normal(0, 1, (GLOBAL_BATCH, FEATURES)).astype("float32"),
            rng.integers(0, CLASSES, (GLOBAL_BATCH,)).astype("int64"))


def shard(step: int, rank: int, nranks: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = batch(step)
    n = GLOBAL_BATCH // nranks
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def build():
    import paddle

    class MLP(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = paddle.nn.Linear(FEATURES, HIDDEN)
            self.act = paddle.nn.ReLU()
            self.head = paddle.nn.Linear(HIDDEN, CLASSES)

        def forward(self, x):
            return self.head(self.act(self.fc1(x)))

    model = MLP()
    w = weights()
    for p, k in ((model.fc1.weight, "w1"), (model.fc1.bias, "b1"), (model.head.weight, "w2"),
                 (model.head.bias, "b2")):
        p.set_value(w[k])
    opt = paddle.optimizer.Adam(learning_rate=0.05, parameters=model.parameters())
    return model, opt


def params(model) -> np.ndarray:
    return np.concatenate([p.numpy().ravel() for p in model.parameters()])


def train(policy, rank: int, nranks: int, inject=(), distributed: bool = True):
    """Losses, skips, scales and params (before/after each step) of STEPS steps under ``policy``."""
    import paddle

    import unimp

    model, opt = build()
    amp = unimp.apply(policy, model, opt)
    net = amp.data_parallel() if distributed else amp.model
    out = {"loss": [], "skipped": [], "scale": [], "before": [], "after": []}
    for step in range(STEPS):
        x, y = shard(step, rank, nranks)
        loss = paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x)), paddle.to_tensor(y))
        amp.backward(loss)
        if step in inject and rank == 1:  # after backward: Paddle's reducer has already all-reduced
            p = model.head.weight
            g = p.grad.numpy()
            g[0, 0] = np.inf
            p.grad.set_value(g)
        out["before"].append(params(model))
        out["skipped"].append(amp.optimizer.step())
        amp.optimizer.clear_grad()
        out["after"].append(params(model))
        out["scale"].append(amp.scale)
        out["loss"].append(float(loss.numpy()))
    out["skipped_steps"] = amp.skipped_steps
    out["native"] = amp.native.get("data_parallel")
    return {k: np.asarray(v) if isinstance(v, list) else v for k, v in out.items()}, amp


def reduced_grads(policy, rank: int, nranks: int) -> tuple[np.ndarray, dict]:
    """Gradients after amp.optimizer.step()'s all-reduce (loss scaling off, one step)."""
    import paddle

    import unimp

    model, opt = build()
    amp = unimp.apply(policy, model, opt)
    net = amp.data_parallel()
    x, y = shard(0, rank, nranks)
    loss = paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x)), paddle.to_tensor(y))
    amp.backward(loss)
    amp.optimizer.step()  # Paddle's optimizer step leaves the (reduced) grads in place
    return np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]), amp.native["data_parallel"]


def manual_wrap_warns(rank: int, nranks: int) -> list[str]:
    """paddle.DataParallel(amp.model) by hand: amp.optimizer.step() warns (no agreed skip)."""
    import paddle

    import unimp

    model, opt = build()
    amp = unimp.apply(SCALED, model, opt)
    net = paddle.DataParallel(amp.model)
    x, y = shard(0, rank, nranks)
    amp.backward(paddle.nn.functional.cross_entropy(net(paddle.to_tensor(x)), paddle.to_tensor(y)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        amp.optimizer.step()
    return [str(c.message) for c in caught if "amp.data_parallel()" in str(c.message)]


def main(out_dir: str) -> None:
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    rank, nranks = dist.get_rank(), dist.get_world_size()
    t = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(t)
    fp16 = paddle.to_tensor([1.5], dtype="float16")
    dist.all_reduce(fp16)
    with open(os.path.join(out_dir, f"probe.{rank}.json"), "w") as f:
        json.dump({"nranks": nranks, "sum": float(t.numpy()[0]),
                   "fp16_sum": float(fp16.astype("float32").numpy()[0])}, f)

    parity, _ = train(SCALED, rank, nranks)
    overflow, _ = train(SCALED, rank, nranks, inject=INJECT)
    grads, native = reduced_grads(BF16_REDUCE, rank, nranks)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"),
             **{f"parity_{k}": v for k, v in parity.items() if k != "native"},
             **{f"overflow_{k}": v for k, v in overflow.items() if k != "native"},
             bf16_grads=grads)
    with open(os.path.join(out_dir, f"native.{rank}.json"), "w") as f:
        json.dump({"fp32": parity["native"], "bf16": native, "manual_warnings": manual_wrap_warns(rank, nranks)},
                  f)


if __name__ == "__main__":
    main(sys.argv[1])
