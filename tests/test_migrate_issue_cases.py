"""The cases issue 24 names, run through the CLI exactly as written there (``unimp import ...`` /
``unimp export ...``): each imports to what its system runs, or is a located refusal with the fix --
never a float32 policy by default, never a traceback. The expected values are the source systems'
(cited per case); the corpus tests (test_real_configs*.py) hold the files these come from."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

import unimp
from unimp.cli import main
from unimp.policy.resolve import parse_text

ROOT = Path(__file__).parent / "fixtures" / "real_configs"


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _facts(text: str, keys) -> dict:
    """The resolved policy's values for ``keys`` (``extends``: the preset the file names)."""
    policy = unimp.load(parse_text(text, "toml"))
    out = {}
    for key in keys:
        node = tomllib.loads(text)["extends"] if key == "extends" else policy
        for part in key.split(".") if key != "extends" else ():
            node = getattr(node, part)
        out[key] = node
    return out


@pytest.mark.parametrize(("args", "want"), [
    # Lightning accelerator_connector.py: 16 -> '16-mixed': MixedPrecision (torch.autocast fp16 + GradScaler())
    (["TRAINER_YAML", "--from", "lightning"], {"extends": "torch_autocast_cuda", "compute_dtype": "float16",
                                               "loss_scale.initial": 65536.0}),
    # Megatron arguments.py: --fp16 + --loss-scale 12 -> ConstantGradScaler(12)
    (['GPT_ARGS="--fp16 --loss-scale 12" --micro-batch-size 4', "--from", "megatron"],
     {"extends": "megatron_fp16", "loss_scale.mode": "static", "loss_scale.initial": 12.0}),
    # apex frontend.py O1: patch_torch_functions, dynamic LossScaler
    (['amp.initialize(model, optimizer, opt_level="O1")', "--from", "apex"],
     {"extends": "apex_o1", "loss_scale.mode": "dynamic"}),
    # apex frontend.py: verbosity is logging; keep_batchnorm_fp32=None keeps O2's True
    (['amp.initialize(model, optimizer, opt_level="O2", verbosity=0, keep_batchnorm_fp32=None)', "--from", "apex"],
     {"extends": "apex_o2", "master_weights.enabled": True, "param_dtype": "float16"}),
    # tf_keras / Keras 3: compile() wraps LossScaleOptimizer for mixed_float16 (initial 2**15, 2000 steps)
    (['set_global_policy("mixed_float16")', "--from", "tf_keras"],
     {"compute_dtype": "float16", "loss_scale.initial": 32768.0, "loss_scale.growth_interval": 2000}),
    (['set_global_policy("mixed_float16")', "--from", "keras"],
     {"compute_dtype": "float16", "loss_scale.initial": 32768.0}),
    (["Trainer(precision=16)", "--from", "lightning"], {"compute_dtype": "float16", "loss_scale.mode": "dynamic"}),
    # fabric/plugins/precision/transformer_engine.py: bf16 weights, DelayedScaling() FP8
    (["Trainer(precision='transformer-engine')", "--from", "lightning"],
     {"param_dtype": "bfloat16", "fp8.enabled": True, "fp8.recipe": "delayed"}),
    # accelerate 'fp8' template: TE recipe over bf16 autocast
    (["ACC_FP8", "--from", "accelerate"], {"compute_dtype": "bfloat16", "fp8.enabled": True}),
    # HF Trainer "auto" with the Trainer's fp16=true (integrations/deepspeed.py trainer_config_process)
    (["HF_ZERO3", "--from", "deepspeed", "--assume", "fp16=true"],
     {"extends": "deepspeed_zero_fp16", "distributed.reduce_dtype": "float16", "param_dtype": "float16"}),
])
def test_the_named_case_imports_what_its_system_runs(args, want, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.yaml").write_text("trainer:\n  precision: 16\n")  # the printf, verbatim
    files = {"TRAINER_YAML": "t.yaml", "ACC_FP8": str(ROOT / "accelerate" / "templates_fp8.yaml"),
             "HF_ZERO3": str(ROOT / "deepspeed" / "hf_ds_config_zero3.json")}
    rc, out, err = _run(["import", *[files.get(a, a) for a in args]], capsys)
    assert rc == 0, err
    assert _facts(out, want) == want


@pytest.mark.parametrize(("args", "located"), [
    # HF "auto" without the Trainer's arguments: the key and the --assume fix
    (["import", "HF_ZERO3", "--from", "deepspeed"], ['fp16.enabled: "auto"', "--assume fp16=true"]),
    # an Accelerate template without mixed_precision that names a DeepSpeed file: the command that imports it
    (["import", "ACC_DS", "--from", "accelerate"], ["deepspeed_config.deepspeed_config_file", "--from deepspeed"]),
    (["import", "distributed_type: MULTI_GPU", "--from", "accelerate"], ["mixed_precision: not given"]),
    # Paddle: a single op of a canonical op is refused, never widened to the whole category
    (["import", "paddle.amp.auto_cast(custom_black_list=['tanh'])", "--from", "paddle"],
     ["custom_black_list[0]: tanh is only part of canonical op 'activation'"]),
    # fleet use_fp16_guard (proto default true) with pure fp16: only fp16_guard() blocks run low
    (["import", "strategy.amp_configs = {'use_pure_fp16': True}", "--from", "paddle"],
     ["amp_configs.use_fp16_guard"]),
    # ZeRO-3 exports stage 1 only with the stage listed: --strict fails on it
    (["export", "ZERO3_POLICY", "--to", "deepspeed", "--strict"], ["zero_optimization.stage"]),
    # downcast_bf16 off TPU: Accelerate raises
    (["import", "ACC_DOWNCAST", "--from", "accelerate"], ["downcast_bf16"]),
])
def test_the_named_case_is_a_located_refusal(args, located, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "down.yaml").write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\ndowncast_bf16: 'yes'\n")
    assert main(["import", str(ROOT / "deepspeed" / "dse_autotuning_fp16_z3.json"), "--from", "deepspeed",
                 "-o", str(tmp_path / "z3.toml")]) == 0
    capsys.readouterr()
    files = {"HF_ZERO3": str(ROOT / "deepspeed" / "hf_ds_config_zero3.json"),
             "ACC_DS": str(ROOT / "accelerate" / "templates_deepspeed.yaml"), "ACC_DOWNCAST": "down.yaml",
             "ZERO3_POLICY": str(tmp_path / "z3.toml")}
    rc, out, err = _run([files.get(a, a) for a in args], capsys)
    assert rc == 1 and "Traceback" not in err, (out, err)
    assert all(s in err for s in located), err


def test_export_fp32_to_megatron_says_what_it_writes(capsys):
    rc, out, err = _run(["export", "fp32", "--to", "megatron"], capsys)
    assert rc == 0 and "float32" in out and "no Megatron argument found" not in err
