"""`unimp import` / `unimp export` in the core: every system's import, the commented policy file,
located errors, DeepSpeed's ZeRO awareness and import -> export -> import identity."""

import json
import re

import pytest

import unimp
from unimp.cli import main
from unimp.loss_scale import LossScaleAtMinimumError, trajectory
from unimp.migrate import export_to, exporters, import_from, importers
from unimp.migrate.export_check import effective

ROUND_TRIPS = [
    ("torch", "GradScaler(init_scale=2**10, growth_interval=50, backoff_factor=0.25)"),
    ("accelerate", "fp16"), ("accelerate", "bf16"), ("accelerate", "no"),
    ("lightning", "16-mixed"), ("lightning", "bf16-true"), ("lightning", "32"),
    ("keras", "mixed_float16"), ("keras", "mixed_bfloat16"), ("tf_keras", "mixed_float16"),
    ("jmp", "p=f32,c=f16,o=f32; DynamicLossScale(loss_scale=1024.0, period=100)"), ("jmp", "bf16"),
    ("flax", "DynamicScale(growth_interval=10, scale=256.0)"),
    ("paddle", "auto_cast(level='O2', custom_white_list=['softmax']); GradScaler(decr_every_n_nan_or_inf=2)"),
    ("deepspeed", '{"fp16": {"enabled": true, "loss_scale_window": 200}, "zero_optimization": {"stage": 3}}'),
    ("deepspeed", '{"fp16": {"enabled": true, "initial_scale_power": 12}}'),
    ("deepspeed", '{"bf16": {"enabled": true}}'),
    ("apex", "O1"), ("apex", "O2, keep_batchnorm_fp32=False, loss_scale=512.0"), ("apex", "O3"), ("apex", "O0"),
    ("apex", "opt_level='O2', min_loss_scale=1.0, max_loss_scale=2.0**30"),
    ("megatron", "--fp16 --initial-loss-scale 65536 --loss-scale-window 100 --hysteresis 4"),
    ("megatron", "--bf16"), ("megatron", "--fp16 --loss-scale 1024 --accumulate-allreduce-grads-in-fp32"),
]


@pytest.mark.parametrize(("system", "raw"), ROUND_TRIPS)
def test_import_export_import_is_identity(system, raw):
    first = import_from(system, raw).policy
    out = export_to(system, first)
    # a ZeRO policy is written with stage 1 and that is listed: the policy holds no ZeRO stage
    assert [u for u in out.unexpressed if not u.startswith("zero_optimization.stage = ")] == [], out.unexpressed
    again = import_from(system, out.config).policy
    assert effective(again) == effective(first)


@pytest.mark.parametrize(("system", "raw"), ROUND_TRIPS)
def test_every_key_of_the_file_names_its_source(system, raw):
    text = import_from(system, raw).text
    body = [line for line in text.splitlines() if "=" in line and not line.startswith("#")]
    assert body and all("  # " in line for line in body)
    assert unimp.load(_write(text)).fingerprint == import_from(system, raw).policy.fingerprint


def _write(text, _n=[0]):  # noqa: B006
    import tempfile
    from pathlib import Path

    _n[0] += 1
    p = Path(tempfile.mkdtemp()) / f"imported{_n[0]}.toml"
    p.write_text(text)
    return str(p)


def test_deepspeed_plain_engine_vs_zero():
    """Without ZeRO FP16_Optimizer has no hysteresis and stays at the floor; ZeRO's DynamicLossScaler
    absorbs `hysteresis` overflows and raises at the floor (deepspeed/runtime/fp16)."""
    cfg = {"fp16": {"enabled": True, "initial_scale_power": 1, "loss_scale_window": 2, "min_loss_scale": 1}}
    finites = [False, False, False, True]
    with pytest.warns(unimp.UnimpWarning, match="hysteresis"):
        plain = importers.deepspeed({**cfg, "fp16": {**cfg["fp16"], "hysteresis": 2}}).policy
    assert trajectory(plain.loss_scale, finites)[0] == [1.0, 1.0, 1.0, 1.0]
    zero = importers.deepspeed({**cfg, "zero_optimization": {"stage": 2}}).policy
    assert zero.loss_scale.hysteresis == 2
    with pytest.raises(LossScaleAtMinimumError):
        trajectory(zero.loss_scale, finites)
    consecutive = importers.deepspeed({**cfg, "fp16": {**cfg["fp16"], "consecutive_hysteresis": True},
                                       "zero_optimization": {"stage": 1}}).policy
    assert "finite" in consecutive.loss_scale.hysteresis_refill


def test_deepspeed_plain_engine_fixture():
    """Fixture (DeepSpeed is not installed in the matrix): FP16_Optimizer._update_scale by hand, with
    loss_scale_window 2, initial_scale_power 4, min_loss_scale 1 -- growth when
    (cur_iter - last_overflow_iter) - 1 is a positive multiple of the window, max(scale / 2, min) on
    overflow, no hysteresis, no error at the floor."""
    cfg = {"fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2}}
    finites = [True, True, True, False, True, True, True, True, True] + [False] * 7
    expected = [16, 16, 32, 16, 16, 16, 32, 32, 64, 32, 16, 8, 4, 2, 1, 1]
    assert trajectory(importers.deepspeed(cfg).policy.loss_scale, finites)[0] == expected


def test_deepspeed_ignores_and_lists_non_precision_keys():
    imp = importers.deepspeed({"train_batch_size": 8, "optimizer": {"type": "Adam"}, "fp16": {"enabled": True}})
    assert imp.ignored == ("train_batch_size", "optimizer")
    assert "Not precision settings (ignored): train_batch_size, optimizer" in imp.text


@pytest.mark.parametrize(("system", "raw", "where"), [
    ("deepspeed", '{"fp16": {"enabled": true, "loss_scale_windw": 10}}', "fp16.loss_scale_windw"),
    ("deepspeed", '{"fp16": {"enabled": "auto"}}', "fp16.enabled"),
    ("accelerate", '{"mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP"}}', "fp8_config.backend"),
    ("lightning", "64-true", "precision"),
    ("paddle", "auto_cast(custom_white_list=['not_an_op'])", "auto_cast.custom_white_list[0]"),
    ("torch", "GradScaler(init_scal=3.0)", "GradScaler.init_scal"),
    ("torch", "GradScaler(growth_interval=0)", "GradScaler.growth_interval"),
    ("flax", "DynamicScale(fin_steps=3)", "fin_steps"),
    ("jmp", "params=float64", "policy.params"),
    ("keras", "int8", "policy"),
    ("apex", "O4", "opt_level"),
    ("apex", "O1, keep_batchnorm_fp32=True", "keep_batchnorm_fp32"),
    ("apex", "O2, cast_model_type='torch.bfloat16'", "cast_model_type"),
    ("megatron", "--fp16 --loss-scale-window ten", "--loss-scale-window"),
    ("megatron", "--fp16 --bf16", "--bf16"),
])
def test_what_cannot_be_expressed_is_a_located_error(system, raw, where, capsys):
    assert main(["import", raw, "--from", system]) == 1
    err = capsys.readouterr().err
    assert f": {where}:" in err and "Traceback" not in err


def test_cli_import_file_and_export(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"fp16": {"enabled": True, "loss_scale_window": 500}}))
    out = tmp_path / "team.toml"
    assert main(["import", str(cfg), "--from", "deepspeed", "-o", str(out)]) == 0
    assert "growth_interval = 500  # fp16.loss_scale_window" in out.read_text()
    assert unimp.load(str(out)).loss_scale.growth_interval == 500
    capsys.readouterr()
    assert main(["export", str(out), "--to", "deepspeed", "--strict"]) == 0
    assert json.loads(capsys.readouterr().out)["fp16"]["loss_scale_window"] == 500


def test_export_lists_what_the_target_cannot_express(capsys):
    assert main(["export", "mixed_fp16", "--to", "torch"]) == 0
    assert "not expressed: loss_scale.max = 16777216.0" in capsys.readouterr().err
    assert main(["export", "mixed_fp16", "--to", "torch", "--strict"]) == 1
    assert "loss_scale.max" in capsys.readouterr().err


# every Paddle op type of canonical op matmul
MATMUL = ["bmm", "einsum", "fused_gemm_epilogue", "matmul", "matmul_v2", "mul"]


def test_paddle_lists_move_canonical_ops_and_export_writes_them_back():
    imp = importers.paddle({"custom_white_list": ["softmax"], "custom_black_list": MATMUL})
    assert imp.policy.ops.category("softmax") == "lower" and imp.policy.ops.category("matmul") == "float32"
    ac = exporters.paddle(imp.policy).config["auto_cast"]
    assert ac["custom_white_list"] == ["softmax"] and ac["custom_black_list"] == MATMUL


@pytest.mark.parametrize(("lists", "where"), [
    ({"custom_black_list": ["tanh"]}, "custom_black_list[0]: tanh is only part of canonical op 'activation'"),
    ({"custom_black_list": ["matmul_v2"]}, "custom_black_list[0]: matmul_v2 is only part of canonical op 'matmul'"),
])
def test_paddle_single_op_names_are_never_widened(lists, where):
    with pytest.raises(unimp.UnsupportedError, match=re.escape(where)):
        importers.paddle(lists)


def test_paddle_op_names_already_in_place_change_nothing():
    """``custom_black_list=['reduce_sum']`` at O1: reduction already runs in float32 (paddle_o1)."""
    assert importers.paddle({"custom_black_list": ["reduce_sum"]}).policy.fingerprint == \
        importers.paddle({}).policy.fingerprint


def test_paddle_amp_configs_defaults_are_fleets():
    ls = importers.paddle_amp_configs({}).policy.loss_scale
    assert (ls.initial, ls.growth_interval, ls.hysteresis, ls.min) == (32768.0, 1000, 2, 1.0)
    assert ls.backoff_factor == pytest.approx(0.8)


def test_apex_overrides_move_ops_and_export_writes_them_back():
    imp = importers.apex("O2", keep_batchnorm_fp32=False, master_weights=False)
    assert imp.policy.ops.category("batch_norm") == "lower" and not imp.policy.master_weights.enabled
    assert "keep_batchnorm_fp32=False" in imp.text
    o2 = importers.apex("O2").policy
    assert o2.ops.category("batch_norm") == "float32" and o2.master_weights.enabled
    assert exporters.apex(importers.apex("O2", keep_batchnorm_fp32=False).policy).config == {
        "opt_level": "O2", "keep_batchnorm_fp32": False}


def test_megatron_lists_other_arguments_and_reduces_in_param_dtype():
    imp = importers.megatron("--fp16 --num-layers 2 --lr=1e-4")
    assert imp.ignored == ("--num-layers", "--lr")
    assert imp.policy.distributed.reduce_dtype == "float16"
    assert imp.policy.loss_scale.initial == 2.0**32 and imp.policy.loss_scale.hysteresis == 2


def test_every_readme_migration_command_runs(monkeypatch, capsys):
    """Each command of docs/migrating.md (the README's "Migrating from" section points there), as written, from
    the repository root."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    assert "(docs/migrating.md)" in (root / "README.md").read_text()
    section = (root / "docs" / "migrating.md").read_text()
    monkeypatch.chdir(root)
    commands = re.findall(r"`(unimp import [^`]*--from \w+(?: --assume \S+)?)`", section)
    assert {c.split("--from ")[1].split()[0] for c in commands} == {
        "lightning", "torch", "keras", "tf_keras", "paddle", "jmp", "flax", "deepspeed", "apex", "accelerate",
        "megatron", "neox", "hf_trainer", "paddlenlp"}
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, (command, capsys.readouterr().err)


def test_paddle_amp_configs_file(tmp_path, capsys):
    f = tmp_path / "amp.yaml"
    f.write_text(f"init_loss_scaling: 1024.0\ncustom_black_list: [{', '.join(MATMUL)}]\n")
    assert main(["import", str(f), "--from", "paddle"]) == 0
    text = capsys.readouterr().out
    assert "initial = 1024.0  # amp_configs.init_loss_scaling" in text
    assert "matmul <- amp_configs.custom_black_list[5]" in text


@pytest.mark.parametrize(("args", "message"), [
    (["import", "fp16", "--from", "deepspeeed"], "did you mean 'deepspeed'?"),
    (["import", "GradScaler(init_scale=" + "[" * 5000 + ")", "--from", "torch"], "cannot read"),
    (["import", "init_scale=__import__('os')", "--from", "torch"], "is not a literal"),
    (["import", "x" * 70000, "--from", "flax"], "at most 65536"),
    (["import", '{"fp16": {"enabled": true, "initial_scale_power": 400}}', "--from", "deepspeed"],
     "fp16.initial_scale_power"),
    (["export", "mixed_fp16", "--to", "nope"], "unknown system"),
])
def test_bad_input_is_one_located_message(args, message, capsys):
    assert main(args) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# Lightning as Lightning reads it (src/lightning/fabric/connector.py::_convert_precision_to_unified_args,
# pytorch/trainer/connectors/accelerator_connector.py::_check_and_init_precision, plugins/precision/*.py)
LIGHTNING = [
    ("Trainer(precision=16)", {"compute_dtype": "float16", "param_dtype": "float32", "mode": "dynamic"}),
    ('trainer = L.Trainer(precision="bf16-mixed", max_epochs=3)', {"compute_dtype": "bfloat16", "mode": "none"}),
    ("trainer:\n  precision: 16\n", {"compute_dtype": "float16", "mode": "dynamic"}),
    ({"trainer": {"precision": "16-mixed", "accelerator": "cpu"}}, {"compute_dtype": "bfloat16", "mode": "none"}),
    ("Trainer(precision='bf16-true')", {"param_dtype": "bfloat16", "output_dtype": "bfloat16", "masters": False}),
    ("Fabric(precision='bf16-true')", {"param_dtype": "bfloat16", "output_dtype": "float32", "masters": False}),
    ("16-true", {"param_dtype": "float16", "mode": "none", "reduce": "float16"}),
    ("transformer-engine", {"param_dtype": "bfloat16", "fp8": "delayed", "mode": "none", "output_dtype": "float32"}),
    ("transformer-engine-float16", {"compute_dtype": "float16", "param_dtype": "float16", "fp8": "delayed"}),
    ("32", {"compute_dtype": "float32", "mode": "none"}),
]


@pytest.mark.parametrize(("raw", "want"), LIGHTNING, ids=lambda v: str(v)[:30])
def test_lightning_reads_every_form_and_value(raw, want):
    p = import_from("lightning", raw).policy
    got = {"compute_dtype": p.compute_dtype, "param_dtype": p.param_dtype, "output_dtype": p.output_dtype,
           "masters": p.master_weights.enabled, "mode": p.loss_scale.mode, "reduce": p.distributed.reduce_dtype,
           "fp8": p.fp8.recipe if p.fp8.enabled else None}
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize(("raw", "message"), [
    ({"fp16": {"enabled": True}}, "nothing read: no `precision` key"),
    ({"trainer": {"devices": 1}}, "nothing read"),
    ({"trainer": {"defaults": ["default"], "accelerator": "gpu"}}, "`defaults` list"),
    ("Trainer(max_epochs=3)", "nothing read: no precision=..."),
    ({"trainer": {"precision": "${oops}"}}, "import the resolved config"),
    ("64-true", "float64"),
    ({"trainer": {"precision": 16, "plugins": ["x"]}}, "trainer.plugins"),
])
def test_lightning_without_a_precision_setting_is_an_error_not_fp32(raw, message):
    with pytest.raises((unimp.PolicyError, unimp.UnsupportedError), match=re.escape(message)):
        import_from("lightning", raw)


@pytest.mark.parametrize(("system", "raw", "facts"), [
    ("keras", "keras.mixed_precision.set_global_policy('mixed_bfloat16')", ("bfloat16", "float32", "none")),
    ("keras", "set_global_policy('mixed_float16')", ("float16", "float32", "dynamic")),
    ("keras", "keras.config.set_dtype_policy('float8_from_mixed_bfloat16')", ("bfloat16", "float32", "none")),
    ("tf_keras", "policy = mixed_precision.Policy('mixed_float16')\nmixed_precision.set_global_policy(policy)",
     ("float16", "float32", "dynamic")),
    ("torch", "with torch.autocast('cuda', dtype=torch.bfloat16):", ("bfloat16", "float32", "none")),
    ("torch", "scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)", ("float16", "float32", "dynamic")),
    ("jmp", "policy = jmp.get_policy('p=f32,c=bf16,o=f32')", ("bfloat16", "float32", "none")),
    ("paddle", "with paddle.amp.auto_cast(level='O2', dtype='bfloat16'):\n    pass\nmodel = paddle.amp.decorate("
               "models=model, level='O2', dtype='bfloat16', master_grad=True)", ("bfloat16", "bfloat16", "none")),
])
def test_verbatim_code_lines(system, raw, facts):
    p = import_from(system, raw).policy
    assert (p.compute_dtype, p.param_dtype, p.loss_scale.mode) == facts


def test_keras_float8_policy_is_the_fp8_table_and_int8_is_refused():
    p = import_from("keras", "float8_from_mixed_bfloat16").policy
    assert p.fp8.enabled and p.fp8.recipe == "delayed" and p.fp8.amax_history == 1024
    assert export_to("keras", p).config["policy"] == "float8_from_mixed_bfloat16"
    with pytest.raises(unimp.UnsupportedError, match="quantizes the weights"):
        import_from("keras", "int8_from_mixed_bfloat16")


def test_paddle_use_fp16_guard_is_refused_in_pure_mode_and_listed_otherwise():
    with pytest.raises(unimp.UnsupportedError, match="use_fp16_guard"):
        importers.paddle_amp_configs({"use_pure_fp16": True})  # the proto's default guard is true
    assert importers.paddle_amp_configs({"use_pure_fp16": True, "use_fp16_guard": False}).policy.param_dtype == \
        "float16"
    assert any("use_fp16_guard" in k for k in importers.paddle_amp_configs({"use_fp16_guard": True}).ignored)


def test_nemo_fp8_keys_are_the_fp8_table():
    """megatron_gpt_config.yaml's fp8 block (fp8_e4m3 -> Format.E4M3, fp8_hybrid -> Format.HYBRID,
    fp8_amax_history_len) as NeMo hands it to Transformer Engine's DelayedScaling."""
    model = {"megatron_amp_O2": True, "fp8": True, "fp8_e4m3": False, "fp8_hybrid": True, "fp8_margin": 0,
             "fp8_interval": 1, "fp8_amax_history_len": 1024, "fp8_amax_compute_algo": "max"}
    p = import_from("lightning", {"trainer": {"precision": "bf16"}, "model": model}).policy
    assert (p.fp8.enabled, p.fp8.recipe, p.fp8.amax_history, p.fp8.gradient_format) == (True, "delayed", 1024, "e5m2")
    e4m3 = import_from("lightning", {"trainer": {"precision": "bf16"},
                                     "model": {**model, "fp8_e4m3": True, "fp8_hybrid": False}}).policy
    assert e4m3.fp8.gradient_format == "e4m3"
    with pytest.raises(unimp.UnsupportedError, match="model.fp8_margin"):
        import_from("lightning", {"trainer": {"precision": "bf16"}, "model": {**model, "fp8_margin": 1}})
