"""A checkpoint written on one Keras backend resumes on another (issue 25).

Each Keras tox env runs this file: keras-tensorflow, then keras-jax, then keras-torch (each has one framework
plus Keras). The env trains a keras_hub GPT-2 tiny causal LM (random init, seeded) ``STEPS`` steps under a
mixed_fp16 policy with unimp, writes ``amp.state_dict()`` + ``model.save_weights`` + what the source did next
(its next ``RESUMED`` losses and loss-scale states) to ``$OBS_DIR/keras-ckpt/<backend>/``, then resumes, each in
a subprocess with ``KERAS_BACKEND`` set to the resuming backend:

* every checkpoint an earlier env left there (keras-jax resumes TensorFlow's, keras-torch TensorFlow's and
  JAX's), under this env's backend, and
* this env's checkpoint under every other Keras backend importable here (none in CI; all of them in a dev env
  with the three frameworks).

Oracles: the loss-scale state after every step is what the core reference ``unimp.loss_scale.LossScale(spec)
.update`` gives from the checkpoint's state, a step's finiteness observed independently (did the weights
change: a skipped step leaves them as they were); the first loss after resume is the source's next loss within
a dtype-derived bound (two float16 forwards, each within ``reference_tolerance`` of exact). The first env finds
no foreign checkpoint and its resume test skips saying so; a later env that finds one must resume it.

Run one resume by hand: ``KERAS_BACKEND=jax python tests_models/test_keras_cross_backend.py CKPT_DIR``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import keras_hub
import numpy as np
import pytest
from keras_env import KERAS_BACKENDS, importable_backends, keras_backend_name
from tolerance import reference_tolerance

import unimp
from unimp.loss_scale import LossScale, LossScaleState

STEPS, RESUMED = 8, 4
# a short growth interval, so the scale moves on every side of the checkpoint (a finite step grows it or counts
# towards growing it, a non-finite one backs off), and the largest initial scale float16 allows (the first float16
# backward overflows: skips are part of the trajectory; this model's gradients stop overflowing near 2**19)
# on_unsupported = "fallback": on JAX's CPU the Plan runs GPT-2's attention in float32 (XLA:CPU compiles no
# float16 x float16 -> float32 dot; unimp_keras.plan.device_fixed), the rest in float16 as elsewhere
POLICY = {"extends": "mixed_fp16", "name": "keras_cross_backend_fp16", "on_unsupported": "fallback",
          "loss_scale": {"growth_interval": 2, "initial": 2.0 ** 24}}
RNG = np.random.default_rng(0)
X = {"token_ids": RNG.integers(0, 64, (4, 12)).astype("int32"), "padding_mask": np.ones((4, 12), bool)}
Y = RNG.integers(0, 64, (4, 12)).astype("int32")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CKPT = Path(os.environ.get("OBS_DIR", ".obs")) / "keras-ckpt"


def gpt2():
    keras.utils.set_random_seed(0)
    bb = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32,
                                       intermediate_dim=64, max_sequence_length=16, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=bb, preprocessor=None)
    model(X)
    return model


def train(model, amp, steps):
    """``steps`` optimizer steps on the fixed batch: each step's loss, finiteness (weights changed) and the
    loss-scale state after it."""
    model.compile(optimizer=amp.optimizer, loss=LOSS, run_eagerly=True)
    out = []
    for _ in range(steps):
        before = model.get_weights()
        # keras.Model.fit: keras_hub's own fit batches numpy with grain or tf.data (neither in the JAX / torch envs)
        loss = keras.Model.fit(model, X, Y, batch_size=len(Y), epochs=1, verbose=0, shuffle=False).history["loss"][0]
        finite = any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
        state = LossScaleState.from_dict(amp.state_dict()).to_dict()
        out.append({"loss": float(loss), "finite": finite, "state": state})
    return out


def follows_reference(start, steps):
    """Every step's state is the core reference's update of the previous one (its finiteness observed)."""
    rule, st = LossScale(unimp.load(POLICY).loss_scale), LossScaleState.from_dict(start)
    for i, s in enumerate(steps):
        st = rule.update(st, s["finite"]).state
        assert s["state"] == st.to_dict(), (i, s, st)


def resume(ckpt: Path) -> dict:
    """Resume ``ckpt`` on this process' backend: fresh model, the saved weights, apply, the saved state."""
    meta = json.loads((ckpt / "meta.json").read_text())
    model = gpt2()
    model.load_weights(str(ckpt / "model.weights.h5"))
    amp = unimp.apply(meta["policy"], model, keras.optimizers.Adam(1e-3))
    amp.load_state_dict(meta["amp_state"])
    loaded = LossScaleState.from_dict(amp.state_dict()).to_dict()
    return {"backend": keras_backend_name(), "loaded": loaded, "units": len(amp._binding.units),
            "steps": train(model, amp, RESUMED)}


def resume_in(backend: str, ckpt: Path) -> dict:
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, __file__, str(ckpt)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"resume of {ckpt} under KERAS_BACKEND={backend} failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_write_checkpoint():
    """This backend's run: it follows the reference, and its checkpoint + continuation land in keras-ckpt/."""
    model = gpt2()
    amp = unimp.apply(POLICY, model, keras.optimizers.Adam(1e-3))
    rule = LossScale(unimp.load(POLICY).loss_scale)
    first = train(model, amp, STEPS)
    follows_reference(rule.initial_state().to_dict(), first)
    assert not first[0]["finite"] and any(s["finite"] for s in first), first  # overflow, then it trains
    out = CKPT / keras_backend_name()
    out.mkdir(parents=True, exist_ok=True)
    model.save_weights(str(out / "model.weights.h5"))
    saved = amp.state_dict()
    continued = train(model, amp, RESUMED)
    follows_reference(saved, continued)
    (out / "meta.json").write_text(json.dumps({"backend": keras_backend_name(), "policy": POLICY, "steps": STEPS,
                                               "amp_state": saved, "continued": continued}, indent=1))


def test_resume_on_another_backend():
    here = keras_backend_name()
    pairs = [(b, here) for b in KERAS_BACKENDS if b != here and (CKPT / b / "meta.json").exists()]
    pairs += [(here, b) for b in importable_backends() if b != here]
    if not pairs:
        pytest.skip(f"no checkpoint from another Keras backend in {CKPT} and no other backend importable here: "
                    f"the first Keras env (keras-tensorflow) only writes; keras-jax / keras-torch resume it")
    for source, target in pairs:
        meta = json.loads((CKPT / source / "meta.json").read_text())
        got = resume_in(target, CKPT / source)
        assert got["backend"] == target
        assert got["loaded"] == LossScaleState.from_dict(meta["amp_state"]).to_dict()
        follows_reference(meta["amp_state"], got["steps"])  # the counter continues: no reset on load
        scales = {meta["amp_state"]["scale"]} | {s["state"]["scale"] for s in got["steps"]}
        assert len(scales) > 1, (source, target, got["steps"])  # the resumed rule moved the scale
        want, have = meta["continued"][0]["loss"], got["steps"][0]["loss"]
        tol = 2 * reference_tolerance("float16", got["units"])  # two float16 forwards, each within the bound
        assert abs(have - want) <= tol * abs(want), (source, target, have, want, tol)


if __name__ == "__main__":  # one resume, in the subprocess resume_in starts: the result as the last line
    print(json.dumps(resume(Path(sys.argv[1]))))
