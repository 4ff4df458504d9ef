"""Hand-written native Paddle AMP vs ``unimp.apply``, side by side in one process (CPU).

    python bench/paddle_bench.py [--steps 30]

Cases (median ms per training step after warm-up, runs interleaved):
  dygraph mixed_bf16: ``paddle.amp.auto_cast(dtype="bfloat16")`` loop vs ``unimp.apply`` (fallback);
  dygraph paddle_o1:  auto_cast fp16 + ``paddle.amp.GradScaler`` vs ``unimp.apply``, three natives:
                      - GradScaler as shipped: it disables itself on CPU (no scaling, no check:
                        not the same work as unimp's scaler, which really scales on CPU);
                      - GradScaler forced on (its own code, the fields its __init__ sets on GPU);
                      - the scaler math by hand (loss * scale, fused check_finite_and_unscale_,
                        one flag read, skip or step, GradScaler._update's rule in Python);
  static mixed_bf16:  ``decorate_bf16`` + AutoMixedPrecisionListsBF16 vs ``unimp.apply`` on the Program.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections import defaultdict

os.environ.setdefault("FLAGS_enable_pir_api", "0")
os.environ.setdefault("FLAGS_use_mkldnn", "0")
os.environ.setdefault("GLOG_minloglevel", "2")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import paddle  # noqa: E402
from paddle.amp.grad_scaler import _refresh_optimizer_state  # noqa: E402

import unimp  # noqa: E402

B, D, H, C = 256, 1024, 1024, 10


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(B, D)).astype("float32"), rng.integers(0, C, (B, 1)).astype("int64")


def _mlp():
    paddle.seed(0)
    return paddle.nn.Sequential(paddle.nn.Linear(D, H), paddle.nn.ReLU(), paddle.nn.Linear(H, C))


def dygraph_native(dtype: str, scaler: bool):
    model = _mlp()
    opt = paddle.optimizer.Adam(1e-3, parameters=model.parameters())
    gs = paddle.amp.GradScaler() if scaler else None
    x, y = (paddle.to_tensor(a) for a in _data())

    def step():
        with paddle.amp.auto_cast(level="O1", dtype=dtype):
            out = model(x)
        loss = paddle.nn.functional.cross_entropy(out.astype("float32"), y)
        if gs is not None:
            gs.scale(loss).backward()
            gs.step(opt)
            gs.update()
        else:
            loss.backward()
            opt.step()
        opt.clear_grad()
    return step


def _forced_gradscaler():
    """paddle.amp.GradScaler with the fields its __init__ sets when enabled (it refuses CPU)."""
    gs = paddle.amp.GradScaler()
    gs._enable, gs._use_dynamic_loss_scaling = True, True
    gs._init_loss_scaling, gs._incr_ratio, gs._decr_ratio = 65536.0, 2.0, 0.5
    gs._incr_every_n_steps, gs._decr_every_n_nan_or_inf = 2000, 1
    gs._incr_count = gs._decr_count = 0
    gs._found_inf = paddle.to_tensor(np.array([0]).astype(np.bool_))
    gs._temp_found_inf_value_false = paddle.to_tensor(np.array([0]).astype(np.bool_))
    gs._temp_found_inf_fp16 = paddle.to_tensor(np.array([0]).astype(np.bool_))
    gs._temp_found_inf_bf16 = paddle.to_tensor(np.array([0]).astype(np.bool_))
    gs._temp_found_inf_fp32 = paddle.to_tensor(np.array([0]).astype(np.bool_))
    gs._scale = paddle.to_tensor(np.array([gs._init_loss_scaling]).astype(np.float32))
    gs._cache_found_inf = None
    gs._optimizer_states = defaultdict(_refresh_optimizer_state)
    return gs


def dygraph_forced_scaler():
    model = _mlp()
    opt = paddle.optimizer.Adam(1e-3, parameters=model.parameters())
    gs = _forced_gradscaler()
    x, y = (paddle.to_tensor(a) for a in _data())

    def step():
        with paddle.amp.auto_cast(level="O1", dtype="float16"):
            out = model(x)
        loss = paddle.nn.functional.cross_entropy(out.astype("float32"), y)
        gs.scale(loss).backward()
        gs.step(opt)
        gs.update()
        opt.clear_grad()
    return step


def dygraph_hand_scaler():
    """The loss-scaling work written by hand in the fewest Paddle calls (paddle_o1's rule)."""
    model = _mlp()
    params = model.parameters()
    opt = paddle.optimizer.Adam(1e-3, parameters=params)
    x, y = (paddle.to_tensor(a) for a in _data())
    state = {"scale": paddle.to_tensor([65536.0], "float32"), "good": 0, "bad": 0}

    def step():
        with paddle.amp.auto_cast(level="O1", dtype="float16"):
            out = model(x)
        loss = paddle.nn.functional.cross_entropy(out.astype("float32"), y)
        (loss * state["scale"]).backward()
        _, found = paddle._C_ops.check_finite_and_unscale_([p.grad for p in params], state["scale"])
        if found.item():
            state["good"], state["bad"] = 0, state["bad"] + 1
            if state["bad"] == 1:
                state["scale"], state["bad"] = state["scale"] * 0.5, 0
        else:
            opt.step()
            state["bad"], state["good"] = 0, state["good"] + 1
            if state["good"] == 2000:
                state["scale"], state["good"] = state["scale"] * 2.0, 0
        opt.clear_grad()
    return step


def dygraph_unimp(policy: str):
    model = _mlp()
    opt = paddle.optimizer.Adam(1e-3, parameters=model.parameters())
    amp = unimp.apply(unimp.load(policy).replace(on_unsupported="fallback"), model, opt)
    x, y = (paddle.to_tensor(a) for a in _data())

    def step():
        loss = paddle.nn.functional.cross_entropy(amp.model(x).astype("float32"), y)
        amp.backward(loss)
        amp.optimizer.step()
        amp.optimizer.clear_grad()
    return step


def static(use_unimp: bool):
    paddle.enable_static()
    main, start = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, start):
        x = paddle.static.data("x", [B, D], "float32")
        y = paddle.static.data("y", [B, 1], "int64")
        h = paddle.static.nn.fc(x, H, activation="relu")
        loss = paddle.mean(paddle.nn.functional.cross_entropy(paddle.static.nn.fc(h, C), y))
        opt = paddle.optimizer.Adam(1e-3)
        if not use_unimp:
            from paddle.static.amp.bf16 import AutoMixedPrecisionListsBF16, decorate_bf16

            lists = AutoMixedPrecisionListsBF16(custom_fp32_list={"elementwise_add"})
            decorate_bf16(opt, amp_lists=lists, use_bf16_guard=False, use_pure_bf16=False).minimize(loss)
    if use_unimp:
        amp = unimp.apply(unimp.load("mixed_bf16").replace(on_unsupported="fallback"), main, opt)
        amp.optimizer.minimize(loss, start)
    exe = paddle.static.Executor(paddle.CPUPlace())
    scope = paddle.static.Scope()
    exe.run(start, scope=scope)
    xv, yv = _data()

    def step():
        exe.run(main, feed={"x": xv, "y": yv}, fetch_list=[loss], scope=scope)
    return step


def measure(pairs, steps: int, warmup: int = 5) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for fn in pairs.values():
        for _ in range(warmup):
            fn()
    order = list(pairs.items())
    for i in range(steps):
        for name, fn in order if i % 2 == 0 else order[::-1]:  # interleaved, alternating who goes first
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    out = {k: statistics.median(v) for k, v in times.items()}
    # paired: each unimp step against the native step next to it in time (robust to load drift)
    out["paired"] = statistics.median(u / n for u, n in zip(times["unimp"], times["native"], strict=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tiny", action="store_true",
                    help="an 8x16->16->4 MLP: compute ~0, so the columns show per-step framework + unimp overhead")
    args = ap.parse_args()
    global B, D, H, C
    if args.tiny:
        B, D, H, C = 8, 16, 16, 4
    cases = {
        "dygraph mixed_bf16": lambda: (dygraph_native("bfloat16", False), dygraph_unimp("mixed_bf16")),
        "dygraph paddle_o1": lambda: (dygraph_native("float16", True), dygraph_unimp("paddle_o1")),
        "  vs GradScaler forced": lambda: (dygraph_forced_scaler(), dygraph_unimp("paddle_o1")),
        "  vs scaler by hand": lambda: (dygraph_hand_scaler(), dygraph_unimp("paddle_o1")),
        "static mixed_bf16": lambda: (static(False), static(True)),  # leaves static mode on
    }
    print(f"paddle {paddle.__version__}, CPU ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}), "
          f"MLP {B}x{D}->{H}->{C}, median of {args.steps} steps (ms)")
    print(f"{'case':24s} {'native':>8s} {'unimp':>8s} {'ratio':>6s} {'paired':>6s}")
    for name, build in cases.items():
        native, ours = build()
        m = measure({"native": native, "unimp": ours}, args.steps)
        print(f"{name:24s} {m['native']:8.2f} {m['unimp']:8.2f} {m['unimp'] / m['native']:6.3f} {m['paired']:6.3f}")


if __name__ == "__main__":
    main()
