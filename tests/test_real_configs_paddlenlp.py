"""PaddleNLP ``TrainingArguments`` (``--from paddlenlp``): real PaddleNLP argument files, verbatim in
``tests/fixtures/real_configs/paddlenlp/`` (repository, path, commit and the cited facts in SOURCES.toml), import
to the numerics PaddleNLP's Trainer runs; the command line as PdArgumentParser reads it; the policy is the
Paddle importer's for the calls the Trainer makes; the export back (``--into`` keeping every other argument).

Facts are written from PaddleNLP's own code (paddlenlp/trainer/trainer.py ``Trainer._wrap_amp_model``,
``autocast_smart_context_manager``, ``create_optimizer``, ``_wrap_model``; training_args.py ``TrainingArguments``
fields and ``__post_init__``; argparser.py ``PdArgumentParser``) and Paddle's (python/paddle/amp/), never
computed by unimp.
"""

from __future__ import annotations

import json
import pathlib
import tomllib
import warnings

import pytest
from test_real_configs_ds import FACTS, _facts

from unimp.cli import _read_source, main
from unimp.errors import PolicyError, UnimpWarning, UnsupportedError
from unimp.migrate import export_to, import_from
from unimp.migrate.export_check import effective
from unimp.migrate.paddlenlp import OWNED

ROOT = pathlib.Path(__file__).with_name("fixtures") / "real_configs" / "paddlenlp"
SOURCES = tomllib.loads((ROOT / "SOURCES.toml").read_text())
ENTRIES = SOURCES["file"]
CHECKED = (*FACTS, "embedding")


def _import(entry: dict):
    raw, source = _read_source(str(ROOT / entry["name"]), "paddlenlp")  # as `unimp import FILE` reads it
    return import_from("paddlenlp", raw, source)


def _nlp(raw, source="run.sh"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return import_from("paddlenlp", raw, source)


def _paddle(calls: str):
    """The policy the Paddle importer gives for Paddle's own calls (what the Trainer makes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return import_from("paddle", calls, "calls").policy


def test_the_corpus_is_what_the_sources_say():
    listed = {e["name"] for e in ENTRIES}
    assert listed == {p.name for p in ROOT.iterdir() if p.name != "SOURCES.toml"}
    for e in ENTRIES:
        assert len(e["commit"]) == 40 and int(e["commit"], 16) >= 0 and e["repository"] == "PaddlePaddle/PaddleNLP"
        cite = SOURCES["cite"][e["cite"]]
        assert all(cite.get(k) for k in (*CHECKED, "error") if k in e and k != "float32_ops"), e["name"]
    assert 5 <= len(ENTRIES) <= 15


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_a_real_argument_file_imports_to_what_the_trainer_runs(entry):
    if "error" in entry:
        with pytest.raises((PolicyError, UnsupportedError)) as e:
            _import(entry)
        assert f": {entry['error']}:" in str(e.value), str(e.value)
        return
    policy = _import(entry).policy
    got = {**_facts(policy), "embedding": policy.ops.category("embedding")}
    want = {k: entry[k] for k in CHECKED if k in entry}
    want.setdefault("fp8", None)
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "error" not in e], ids=lambda e: e["name"])
def test_import_export_import_and_into_keep_the_file(entry):
    """The export re-imports to the same policy; exported into the original file, every argument that is
    not a precision key is kept as it was, and the merged file imports to the same policy."""
    first = _import(entry)
    out = export_to("paddlenlp", first.policy)
    assert out.unexpressed == ()
    assert effective(_nlp(out.config).policy) == effective(first.policy)
    raw, _ = _read_source(str(ROOT / entry["name"]), "paddlenlp")
    merged = export_to("paddlenlp", first.policy, into=raw)
    assert {k: v for k, v in merged.config.items() if k not in OWNED} == {k: v for k, v in raw.items()
                                                                          if k not in OWNED}
    assert list(merged.config) == list(raw)  # nothing added, nothing moved: the file's own keys, in place
    assert effective(_nlp(merged.config).policy) == effective(first.policy)
    assert merged.unexpressed == () and merged.changed == ()


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "error" not in e], ids=lambda e: e["name"])
def test_no_argument_is_dropped_silently(entry):
    imp = _import(entry)
    raw, _ = _read_source(str(ROOT / entry["name"]), "paddlenlp")
    for key in raw:
        assert key in imp.ignored or key in imp.text, key


# ---------------------------------------------------------------- the Trainer's calls, through the Paddle importer


def test_fp16_o1_is_the_trainers_auto_cast_and_grad_scaler():
    """trainer.py Trainer.autocast_smart_context_manager: auto_cast(True, custom_black_list={'reduce_sum',
    'c_softmax_with_cross_entropy'} | amp_custom_black_list, level=fp16_opt_level (default 'O1'), dtype='float16');
    Trainer._wrap_amp_model: GradScaler(init_loss_scaling=scale_loss), do_grad_scaling for fp16."""
    got = _nlp("python -u run_finetune.py --fp16 --scale_loss 1024 --amp_custom_white_list softmax "
               "--output_dir out").policy
    want = _paddle("with paddle.amp.auto_cast(True, custom_white_list={'softmax'}, custom_black_list={'reduce_sum', "
                   "'c_softmax_with_cross_entropy'}, level='O1', dtype='float16'):\n    pass\n"
                   "scaler = paddle.amp.GradScaler(init_loss_scaling=1024)")
    assert effective(got) == effective(want)
    assert (got.compute_dtype, got.param_dtype, got.ops.category("softmax"), got.loss_scale.initial,
            got.loss_scale.growth_interval) == ("float16", "float32", "lower", 1024.0, 2000)
    default = _nlp({"fp16": True}).policy.loss_scale  # training_args.py: scale_loss default 2**15
    assert (default.mode, default.initial) == ("dynamic", 32768.0)


def test_bf16_o2_with_master_grad_is_decorate_with_master_grad():
    """Trainer._wrap_amp_model: decorate(models, level='O2', dtype='bfloat16'); create_optimizer: multi_precision
    at O2; _wrap_model: amp_master_grad -> MixPrecisionLayer (float32 main_grad, Paddle's decorate(master_grad=True));
    bf16: do_grad_scaling False, no GradScaler. The Trainer's O2 white list lookup_table / lookup_table_v2 is the
    embedding lookup (Paddle's EXTRA_BLACK_LIST op): canonical op embedding, all its Paddle op types."""
    got = _nlp("--bf16 --fp16_opt_level O2 --amp_master_grad").policy
    want = _paddle("with paddle.amp.auto_cast(True, custom_white_list=['lookup_table_v2', 'embedding'], "
                   "custom_black_list=['reduce_sum', 'c_softmax_with_cross_entropy'], level='O2', dtype='bfloat16'):\n"
                   "    pass\nmodel = paddle.amp.decorate(models=model, level='O2', dtype='bfloat16', "
                   "master_grad=True)")
    assert effective(got) == effective(want)
    assert (got.param_dtype, got.master_weights.enabled, got.distributed.reduce_dtype, got.loss_scale.mode,
            got.ops.category("embedding")) == ("bfloat16", True, "float32", "none", "lower")
    assert _nlp("--bf16 --fp16_opt_level O2").policy.distributed.reduce_dtype == "bfloat16"
    o1 = _nlp("--bf16 --amp_master_grad")  # O1: float32 params, their gradients float32 already
    assert effective(o1.policy) == effective(_nlp("--bf16").policy) and "nothing changes" in o1.text


def test_json_values_are_read_as_pdargumentparser_reads_them(tmp_path):
    """argparser.py PdArgumentParser.read_json: every value handed over as --key str(value): booleans through
    strtobool (1/0, "true"), scale_loss as float("1024"); a positional *.json is the file the flags override
    (parse_json_file_and_cmd_lines)."""
    p = _nlp({"bf16": 0, "fp16": 1, "scale_loss": "1024", "fp16_opt_level": "O2"}, "args.json").policy
    assert (p.compute_dtype, p.param_dtype, p.loss_scale.initial) == ("float16", "float16", 1024.0)
    assert _nlp({"bf16": False, "fp16": False}).policy.compute_dtype == "float32"
    f = tmp_path / "sft_argument.json"
    f.write_text(json.dumps({"fp16": True, "fp16_opt_level": "O2", "learning_rate": 3e-5}))
    over = _nlp(f"python -m paddle.distributed.launch --gpus 0,1 run_finetune.py {f} --fp16_opt_level O1").policy
    assert (over.compute_dtype, over.param_dtype) == ("float16", "float32")
    with pytest.raises(UnsupportedError, match=r"run.sh: missing.json: no such file"):
        _nlp("python run_finetune.py missing.json")


@pytest.mark.parametrize(("raw", "key"), [
    ("--fp16 --bf16", "bf16"),  # training_args.py __post_init__: 'At most one of fp16 and bf16 can be True'
    ({"learning_rate": 3e-5}, "bf16"),  # no fp16 / bf16: not a float32 policy by default, a located error
    ({"bf16": True, "fp16_opt_level": "o2"}, "fp16_opt_level"),  # the Trainer compares to "O2" as written
    ({"bf16": True, "amp_custom_black_list": "reduce_sum sin"}, "amp_custom_black_list"),  # one op name 'a b'
    ({"bf16": True, "amp_custom_white_list": ["not_an_op"]}, "amp_custom_white_list[0]"),
    ({"bf16": True, "amp_custom_white_list": ["matmul", ["softmax"]]}, "amp_custom_white_list[1]"),
    ({"fp16": True, "amp_custom_white_list": ["softmax", "reduce_sum"]}, "amp_custom_white_list[1]"),  # overlap
    ({"fp16": True, "amp_custom_white_list": ["tanh"]}, "amp_custom_white_list[0]"),  # part of 'activation'
    ({"bf16": True, "fp16_opt_level": "O2", "amp_custom_black_list": ["embedding"]}, "amp_custom_black_list[0]"),
    ({"fp16": True, "fp16-opt-level": "O2"}, "fp16-opt-level"),  # PdArgumentParser flags are the field names
    ({"fp16": True, "scale_loss": 0}, "scale_loss"),
    ({"bf16": "maybe"}, "bf16"),
    ({"bf16": True, "enable_auto_parallel": True}, "enable_auto_parallel"),  # AutoTrainer's strategy.amp
])
def test_what_paddlenlp_refuses_or_the_file_does_not_say_is_a_located_error(raw, key):
    with pytest.raises((PolicyError, UnsupportedError)) as e:
        _nlp(raw)
    assert f"run.sh: {key}:" in str(e.value)


@pytest.mark.parametrize("raw", [
    {"fp16": True, "fp16_opt_level": "O2", "scale_loss": 1024},
    '{"fp16": true, "fp16_opt_level": "O2", "scale_loss": 1024}',
    "--fp16 --scale_loss 1024",
])
def test_the_paddle_importer_points_trainer_arguments_to_paddlenlp(raw):
    with pytest.raises(PolicyError) as e:
        import_from("paddle", raw, "args.json")
    assert "args.json: fp16:" in str(e.value) and "--from paddlenlp" in str(e.value)


# ---------------------------------------------------------------- export


def test_export_writes_the_lists_and_strict_fails_on_what_the_arguments_cannot_hold():
    imp = _nlp({"fp16": True, "fp16_opt_level": "O2", "amp_custom_white_list": ["softmax"], "scale_loss": 4096})
    out = export_to("paddlenlp", imp.policy)
    assert out.config == {"fp16": True, "fp16_opt_level": "O2", "scale_loss": 4096.0,
                          "amp_custom_white_list": ["softmax"]}
    assert effective(_nlp(out.config).policy) == effective(imp.policy)
    assert "--amp_custom_white_list softmax" in out.text
    other = _paddle("auto_cast(level='O1'); GradScaler(incr_every_n_steps=1000)")  # the Trainer's GradScaler: defaults
    assert any(u.startswith("loss_scale.growth_interval = 1000") for u in export_to("paddlenlp", other).unexpressed)
    with pytest.raises(UnsupportedError, match="paddlenlp cannot express"):
        export_to("paddlenlp", other, strict=True)


def test_the_cli_imports_a_file_and_merges_into_it(tmp_path, capsys):
    src = ROOT / "gpt-3_pretrain_argument.json"
    policy = tmp_path / "p.toml"
    assert main(["import", str(src), "--from", "paddlenlp", "-o", str(policy)]) == 0
    args = tmp_path / "args.json"
    args.write_text(src.read_text())
    capsys.readouterr()
    assert main(["export", "mixed_bf16", "--to", "paddlenlp", "--into", str(args)]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert merged["bf16"] is True and "fp16" not in merged and merged["max_seq_length"] == 1024
