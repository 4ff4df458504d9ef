"""Issue 34, migration's last mile: exports into the user's file keep what they did not change, the
Megatron family's float32 loss, apex O2's fp16 reduce, Paddle's bare auto_cast, and input the source
systems accept (hjson comments, YAML merge keys, set literals, whole scripts)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import unimp
from unimp.cli import main
from unimp.errors import UnimpWarning
from unimp.migrate import export_to, import_from

ROOT = Path(__file__).parent / "fixtures" / "real_configs"
OTHER = {"train_batch_size": 16, "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
         "steps_per_print": 10}


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return fn(*a, **k)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("low", ["fp16", "bf16"])
def test_deepspeed_round_trip_into_the_file_keeps_the_stage_and_every_other_key(low, stage, tmp_path, capsys):
    """import ds.json -> export --into ds.json --strict: the same policy, zero_optimization (stage and
    all) and every non-precision key byte-equal in value."""
    zero = {"stage": stage, "overlap_comm": True, "reduce_bucket_size": 5e8}
    cfg = {low: {"enabled": True, **({"loss_scale_window": 500} if low == "fp16" else {})},
           "zero_optimization": zero, **OTHER}
    src = tmp_path / "ds.json"
    src.write_text(json.dumps(cfg))
    assert main(["import", str(src), "--from", "deepspeed", "-o", str(tmp_path / "p.toml")]) == 0
    capsys.readouterr()
    assert main(["export", str(tmp_path / "p.toml"), "--to", "deepspeed", "--into", str(src), "--strict"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in merged.items() if k not in ("fp16", "bf16")} == {"zero_optimization": zero, **OTHER}
    first = _quiet(import_from, "deepspeed", cfg).policy
    assert _quiet(import_from, "deepspeed", merged).policy.fingerprint == first.fingerprint


def test_strict_fails_on_what_the_file_does_not_express():
    """A policy without ZeRO's scaler into a ZeRO-2 file: the file's stage runs another scaler (listed,
    --strict refuses); a ZeRO policy into a stage-0 file must raise the stage: listed too."""
    plain_fp16 = _quiet(import_from, "deepspeed", {"fp16": {"enabled": True}}).policy
    zero_file = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}, **OTHER}
    out = export_to("deepspeed", plain_fp16, into=zero_file)
    assert out.config["zero_optimization"] == {"stage": 2} and any("hysteresis" in u for u in out.unexpressed)
    with pytest.raises(unimp.UnsupportedError):
        export_to("deepspeed", plain_fp16, into=zero_file, strict=True)
    zero_policy = _quiet(import_from, "deepspeed", zero_file).policy
    with pytest.raises(unimp.UnsupportedError, match="zero_optimization.stage = 0 in --into"):
        export_to("deepspeed", zero_policy, into={"fp16": {"enabled": True}, **OTHER}, strict=True)
    with pytest.raises(unimp.PolicyError, match="--into: megatron's configuration is not a file"):
        export_to("megatron", zero_policy, into={"a": 1})


def test_bigscience_export_to_megatron_adds_no_flag_the_source_lacks():
    """bigscience-workshop/Megatron-DeepSpeed megatron/model/gpt_model.py get_cross_entropy:
    ``losses = mpu.vocab_parallel_cross_entropy(output.contiguous().float(), labels)`` and GPTModelPipe's
    last spec ``float16_to_fp32``: the loss and the outputs in float32, so Megatron-LM's own
    Float16Module run holds the policy without --fp16-lm-cross-entropy."""
    from unimp.cli import _read_source

    raw, src = _read_source(str(ROOT / "megatron" / "bigscience_tr11-176B-ml.slurm"), "megatron")
    p = _quiet(import_from, "megatron", raw, src).policy
    assert (p.output_dtype, p.ops.category("loss")) == ("float32", "float32")
    out = export_to("megatron", p)
    assert "--fp16-lm-cross-entropy" not in out.text and out.unexpressed == ()


@pytest.mark.parametrize(("args", "loss", "output"), [
    # microsoft/Megatron-DeepSpeed@f4157bea megatron/model/gpt_model.py post_language_model_processing:
    # "if fp16_lm_cross_entropy: ... loss = cross_entropy(output, labels)
    #  else: loss = cross_entropy(output.float(), labels)"
    ("--no-pipeline-parallel", "float32", "bfloat16"),
    ("--no-pipeline-parallel --fp16-lm-cross-entropy", "lower", "bfloat16"),
    ("", "float32", "float32"),  # GPTModelPipe: CrossEntropy .float(), specs end with float16_to_fp32
])
def test_megatron_deepspeed_loss_runs_on_float32_logits_unless_asked(args, loss, output):
    script = ("config_json=ds.json\ncat <<EOT > $config_json\n{\"bf16\": {\"enabled\": true}}\nEOT\n"
              f"python pretrain_gpt.py --bf16 --deepspeed --deepspeed_config $config_json {args}\n")
    p = _quiet(import_from, "megatron", script, "run.sh").policy
    assert (p.ops.category("loss"), p.output_dtype) == (loss, output)


@pytest.mark.parametrize(("fp16_ce", "loss"), [(False, "float32"), (True, "lower")])
def test_neox_loss_on_float32_logits_unless_fp16_lm_cross_entropy(fp16_ce, loss):
    """EleutherAI/gpt-neox megatron/model/gpt2_model.py cross_entropy: ``if _fp16: ... (output.contiguous())
    else: losses = mpu.vocab_parallel_cross_entropy(output.float().contiguous(), labels)``."""
    p = import_from("neox", {"precision": "fp16", "fp16_lm_cross_entropy": fp16_ce}).policy
    assert p.ops.category("loss") == loss and p.output_dtype == "float16"


def test_neox_bfloat16_precision_is_bf16_and_fp16_type_is_warned():
    """``precision: "bfloat16"`` is a bf16 run (no advice to add ``fp16: enabled false``);
    ``fp16: {type: bfloat16}`` is an fp16 run (DeeperSpeed reads only fp16.enabled), warned."""
    p = import_from("neox", {"precision": "bfloat16", "zero_optimization": {"stage": 1}}).policy
    assert (p.param_dtype, p.loss_scale.mode, p.distributed.reduce_dtype) == ("bfloat16", "none", "bfloat16")
    with pytest.warns(UnimpWarning, match=r"fp16.type = 'bfloat16': not read"):
        p = import_from("neox", {"fp16": {"enabled": True, "type": "bfloat16"}}).policy
    assert p.param_dtype == "float16"
    with pytest.raises(unimp.PolicyError, match="precision: 'fp16' while the bf16 block is enabled"):
        import_from("neox", {"precision": "fp16", "bf16": {"enabled": True}})


def test_neox_amp_block_without_precision_is_deepspeeds_apex_amp():
    """A NeoX config whose only precision key is an ``amp`` block (no ``precision``, no fp16/bf16 block) hands
    that block to DeepSpeed, which runs apex AMP with it: the policy DeepSpeed's own config gives (it was a
    raw KeyError: None)."""
    amp = {"enabled": True, "opt_level": "O2"}
    imp = _quiet(import_from, "neox", {"amp": amp})
    native = _quiet(import_from, "deepspeed", {"amp": amp, "zero_optimization": {"stage": 0},
                                               "fp16": {"enabled": False}})
    assert imp.policy.fingerprint == native.policy.fingerprint
    assert "precision not given: the DeepSpeed amp block (amp)" in imp.text


def test_neox_yaml_dialect_and_round_trip(tmp_path, capsys):
    text = ('{\n  # a NeoX file\n  "precision": "bfloat16",\n'
            '  "zero_optimization": {"stage": 1, "overlap_comm": True,},\n  "num-layers": 12,\n}\n')
    src = tmp_path / "n.yml"
    src.write_text(text)
    assert main(["import", str(src), "--from", "neox", "-o", str(tmp_path / "p.toml")]) == 0
    assert main(["export", str(tmp_path / "p.toml"), "--to", "neox", "--into", str(src), "--strict"]) == 0
    import yaml

    merged = yaml.safe_load(capsys.readouterr().out)
    assert merged["num-layers"] == 12 and merged["zero_optimization"] == {"stage": 1, "overlap_comm": True}


def test_apex_o2_reduces_in_float16():
    """NVIDIA/apex apex/parallel/distributed.py DistributedDataParallel(allreduce_always_fp32=False): the
    O2/O3 model's fp16 grads are all-reduced as they are; O1 keeps float32 weights and grads."""
    assert import_from("apex", "O2").policy.distributed.reduce_dtype == "float16"
    assert import_from("apex", "O3").policy.distributed.reduce_dtype == "float16"
    assert import_from("apex", "O1").policy.distributed.reduce_dtype == "float32"


def test_paddle_bare_auto_cast_is_unscaled_with_a_warning():
    with pytest.warns(UnimpWarning, match="no GradScaler given"):
        p = import_from("paddle", "with paddle.amp.auto_cast():").policy
    assert (p.compute_dtype, p.loss_scale.mode, p.loss_scale.skip_nonfinite) == ("float16", "none", False)


def test_deepspeed_json_with_comments_is_read_as_deepspeed_reads_it(tmp_path):
    """deepspeed/runtime/config.py DeepSpeedConfig: hjson.load(...): //, # and /* */ comments."""
    src = tmp_path / "ds.json"
    src.write_text('// zero-2\n{\n  "bf16": {"enabled": true}, # A100\n'
                   '  /* p */ "zero_optimization": {"stage": 2}\n}\n')
    assert main(["import", str(src), "--from", "deepspeed", "-o", str(tmp_path / "p.toml")]) == 0
    assert unimp.load(str(tmp_path / "p.toml")).param_dtype == "bfloat16"
    src.write_text('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}')
    with pytest.raises(unimp.PolicyError, match="fp16: given twice"):
        import_from("deepspeed", src.read_text(), "ds.json")


def test_accelerate_yaml_merge_keys_are_read_and_policy_files_still_refuse_them(tmp_path):
    src = tmp_path / "acc.yaml"
    src.write_text("base: &b\n  mixed_precision: bf16\n<<: *b\ndistributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert main(["import", str(src), "--from", "accelerate", "-o", str(tmp_path / "p.toml")]) == 0
    assert unimp.load(str(tmp_path / "p.toml")).compute_dtype == "bfloat16"
    pol = tmp_path / "team.yaml"
    pol.write_text("base: &b\n  compute_dtype: bfloat16\n<<: *b\n")
    with pytest.raises(unimp.PolicyError, match="merge keys"):
        unimp.load(str(pol))


def test_pasted_code_as_the_system_reads_it(capsys):
    """Paddle's docs' set literal; a Keras script whose other statements set nothing; a value's text
    quoted whole in an error."""
    p = import_from("paddle", "with paddle.amp.auto_cast(custom_black_list={'softmax'}):\n    pass\n"
                              "scaler = paddle.amp.GradScaler()").policy if _paddle_table() else None
    if p is not None:
        assert p.ops.category("softmax") == "float32"
    script = ("import keras\nkeras.mixed_precision.set_global_policy('mixed_float16')\n"
              "print(keras.mixed_precision.global_policy())\nfor x in range(3):\n    model.fit(x)\n")
    assert import_from("keras", script).policy.compute_dtype == "float16"
    with pytest.raises(unimp.PolicyError, match=r"'\[paddle.nn.Conv2D\]' is not a literal"):
        import_from("torch", "init_scale=[paddle.nn.Conv2D]")


def _paddle_table() -> bool:
    from unimp.backend.registry import backends

    return "paddle" in backends()
