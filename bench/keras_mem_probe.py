"""Where a Keras-on-JAX variant's peak device memory is reached (bench/keras_hub_gpu.py's variants, issue 31).

    KERAS_BACKEND=jax python bench/keras_mem_probe.py [--smoke] [--static] [--out DIR]

Each variant alone in a fresh subprocess: the device's ``peak_bytes_in_use`` after the model is built, after
``unimp.apply`` (unimp's variant), after ``compile``, and after each of the first steps; then XLA's static
accounting of the jitted train step (``memory_analysis()``: temp, argument, output, alias bytes) and the state's
leaves. A peak reached before the first step is not the step's; a step whose temp bytes equal the twin's costs
the same. ``--static``: no step runs (the optimizer is built, the step compiled, not run): XLA's accounting
alone, which a CPU gives for the full-size model too. ``--out DIR``: the JSON and each variant's StableHLO.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras_hub_gpu as K


def _peak() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def analyse(name: str, smoke: bool, out: str | None, static: bool = False) -> dict[str, Any]:
    import jax

    import unimp

    marks: dict[str, float | None] = {"start": _peak()}
    real_apply = unimp.apply

    def apply(*a: Any, **k: Any) -> Any:
        marks["built"] = _peak()
        amp = real_apply(*a, **k)
        marks["applied"] = _peak()
        return amp

    unimp.apply = apply
    x, y = K.data(smoke)
    model = K.build(name, smoke)
    marks["compiled"] = _peak()
    if static:  # what a first step builds, without running it
        model._symbolic_build(data_batch=(x, y, None))
        model.optimizer.build(model.trainable_variables)
    for i in range(0 if static else 4):
        K.step(model, x, y)
        marks[f"step {i + 1}"] = _peak()
    state = model._get_jax_state(trainable_variables=True, non_trainable_variables=True, optimizer_variables=True,
                                 metrics_variables=True, purge_model_variables=False)
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y, None))
    ma = lowered.compile().memory_analysis()
    res: dict[str, Any] = {"peak_gib_after": marks}
    res["step_gib"] = {k: getattr(ma, k) / 2**30 for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                           "output_size_in_bytes", "alias_size_in_bytes")}
    res["state_leaves"] = [len(jax.tree_util.tree_leaves(s)) for s in state]
    res["state_gib"] = [sum(v.nbytes for v in jax.tree_util.tree_leaves(s)) / 2**30 for s in state]
    if out:
        with open(os.path.join(out, name.replace(" ", "_") + ".stablehlo.txt"), "w") as f:
            f.write(lowered.as_text())
    return res


def main() -> None:
    smoke, static = "--smoke" in sys.argv, "--static" in sys.argv
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    if "--one" in sys.argv:
        K.register_backend()
        print("RESULT " + json.dumps(analyse(sys.argv[sys.argv.index("--one") + 1], smoke, out, static)), flush=True)
        return
    result = {}
    for name in (n for n in K.VARIANTS if "A/A" not in n):
        cmd = [sys.executable, __file__, "--one", name, *(["--smoke"] if smoke else []),
               *(["--static"] if static else []),
               *(["--out", out] if out else [])]
        p = subprocess.run(cmd, capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        result[name] = json.loads(line[-1][7:]) if line else {"error": p.stderr[-2000:]}
        print(name, json.dumps(result[name]), flush=True)
    if out:
        with open(os.path.join(out, "keras_mem_probe.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
