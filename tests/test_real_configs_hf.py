"""HF Trainer ``TrainingArguments`` (``--from hf_trainer``): real LLaMA-Factory and alignment-handbook files,
verbatim in ``tests/fixtures/real_configs/hf_trainer/`` (repository, path, commit and the cited facts in
SOURCES.toml), import to the numerics HF Trainer runs; the command-line form, the composition with the
DeepSpeed importer, and the export back (``--into`` keeping every other argument).

Facts are written from HF's own code (transformers 5.24 training_args.py ``TrainingArguments.__post_init__``,
trainer.py ``_build_accelerator_args``; 4.x apex from huggingface/transformers@fd798335 trainer.py), never
computed by unimp.
"""

from __future__ import annotations

import pathlib
import shutil
import tomllib
import warnings

import pytest
from test_real_configs_ds import FACTS, _facts

from unimp.cli import _read_source, main
from unimp.errors import PolicyError, UnimpWarning, UnsupportedError
from unimp.migrate import export_to, import_from
from unimp.migrate.export_check import effective
from unimp.migrate.hf_trainer import OWNED

ROOT = pathlib.Path(__file__).with_name("fixtures") / "real_configs"
SOURCES = tomllib.loads((ROOT / "hf_trainer" / "SOURCES.toml").read_text())
ENTRIES = SOURCES["file"]


@pytest.fixture
def repo_root(tmp_path, monkeypatch):
    """A directory laid out as LLaMA-Factory's root (its ds_z3_config.json at the corpus commit), the
    working directory its train YAML files name ``examples/deepspeed/...`` from."""
    ds = tmp_path / "examples" / "deepspeed"
    ds.mkdir(parents=True)
    shutil.copy(ROOT / "deepspeed" / "llamafactory_ds_z3_config.json", ds / "ds_z3_config.json")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _import(entry: dict):
    raw, source = _read_source(str(ROOT / "hf_trainer" / entry["name"]), "hf_trainer")  # as `unimp import FILE`
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return import_from("hf_trainer", raw, source)


def test_the_corpus_is_what_the_sources_say():
    listed = {e["name"] for e in ENTRIES}
    assert listed == {p.name for p in (ROOT / "hf_trainer").iterdir() if p.name != "SOURCES.toml"}
    for e in ENTRIES:
        assert len(e["commit"]) == 40 and int(e["commit"], 16) >= 0 and "/" in e["repository"]
        cite = SOURCES["cite"][e["cite"]]
        assert all(cite.get(k) for k in (*FACTS, "error") if k in e and k != "float32_ops"), e["name"]
    assert len(ENTRIES) >= 40


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_a_real_trainer_file_imports_to_what_hf_trainer_runs(entry, repo_root):
    if "error" in entry:
        with pytest.raises((PolicyError, UnsupportedError)) as e:
            _import(entry)
        assert f": {entry['error']}:" in str(e.value), str(e.value)
        return
    got = _facts(_import(entry).policy)
    want = {k: entry[k] for k in FACTS if k in entry}
    want.setdefault("fp8", None)
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "error" not in e], ids=lambda e: e["name"])
def test_import_export_import_and_into_keep_the_file(entry, repo_root):
    """The export re-imports to the same policy (or lists why, and --strict fails); exported into the
    original file, every argument that is not a precision key is kept as it was."""
    first = _import(entry)
    out = export_to("hf_trainer", first.policy)
    lost = [u for u in out.unexpressed if ".zero_optimization.stage = " not in u]
    if lost:
        with pytest.raises(UnsupportedError):
            export_to("hf_trainer", first.policy, strict=True)
    else:
        assert effective(import_from("hf_trainer", out.config, "re-import").policy) == effective(first.policy)
    raw, _ = _read_source(str(ROOT / "hf_trainer" / entry["name"]))
    merged = export_to("hf_trainer", first.policy, into=raw)
    assert {k: v for k, v in merged.config.items() if k not in OWNED} == {k: v for k, v in raw.items()
                                                                          if k not in OWNED}
    assert effective(_import_raw(merged.config)) == effective(first.policy)
    assert merged.unexpressed == ()  # into its own file, nothing is lost


def _import_raw(raw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return import_from("hf_trainer", raw, "merged").policy


@pytest.mark.parametrize("entry", [e for e in ENTRIES if "error" not in e], ids=lambda e: e["name"])
def test_no_argument_is_dropped_silently(entry, repo_root):
    imp = _import(entry)
    raw, _ = _read_source(str(ROOT / "hf_trainer" / entry["name"]))
    for key in raw:
        assert key in imp.ignored or key in imp.text, key


# ---------------------------------------------------------------- the command line and the other systems


def test_the_command_line_reads_as_hfargumentparser_reads_it():
    """hf_argparser.py: a bool field is ``nargs="?", const=True`` (``--bf16`` alone is true, ``--bf16 False``
    false, string_to_bool); ``--fp16`` is Accelerate fp16: autocast + GradScaler with Accelerate's
    GradScalerKwargs defaults (accelerate utils/dataclasses.py: init_scale 65536.0, growth_interval 2000)."""
    fp16 = import_from("hf_trainer", "torchrun train.py --fp16 --learning_rate 2e-5 \\\n  --output_dir out", "run.sh")
    ls = fp16.policy.loss_scale
    assert (fp16.policy.compute_dtype, fp16.policy.param_dtype, ls.mode, ls.initial, ls.growth_interval,
            ls.growth_factor, ls.backoff_factor) == ("float16", "float32", "dynamic", 65536.0, 2000, 2.0, 0.5)
    assert {"learning_rate", "output_dir"} <= set(fp16.ignored)
    assert effective(fp16.policy) == effective(import_from("accelerate", "fp16", "x").policy)
    bf16 = import_from("hf_trainer", "--bf16 True --fp16 False", "run.sh").policy
    assert (bf16.compute_dtype, bf16.loss_scale.mode) == ("bfloat16", "none")
    assert import_from("hf_trainer", "--bf16 false --fp16 no", "run.sh").policy.compute_dtype == "float32"


def test_deepspeed_decides_and_its_auto_values_come_from_the_arguments(tmp_path):
    """``--deepspeed ds.json``: integrations/deepspeed.py trainer_config_process fills "auto" from
    --bf16/--fp16; the same policy as `unimp import ds.json --from deepspeed --assume bf16=true`."""
    ds = tmp_path / "ds.json"
    shutil.copy(ROOT / "deepspeed" / "axolotl_zero3.json", ds)
    got = import_from("hf_trainer", f"--bf16 --deepspeed {ds}", "run.sh").policy
    raw, _ = _read_source(str(ds), "deepspeed")
    assert effective(got) == effective(import_from("deepspeed", raw, "ds.json", {"bf16": "true"}).policy)
    fp16 = import_from("hf_trainer", {"fp16": True, "deepspeed": str(ds)}, "args.json").policy
    assert (fp16.param_dtype, fp16.loss_scale.initial, fp16.loss_scale.hysteresis) == ("float16", 2.0 ** 32, 2)
    with pytest.raises(UnsupportedError, match=r"run.sh: deepspeed: 'missing.json': no such file"):
        import_from("hf_trainer", "--bf16 --deepspeed missing.json", "run.sh")


def test_fp16_full_eval_and_tf32_are_not_training_dtypes():
    """trainer.py evaluation_loop: fp16_full_eval casts the model for evaluation only; training_args.py
    __post_init__: tf32 calls enable_tf32 (torch.backends.cuda.matmul.allow_tf32), which unimp holds no key
    for: noted and warned, the policy is the bf16 one."""
    with pytest.warns(UnimpWarning, match="tf32 = true: enable_tf32"):
        imp = import_from("hf_trainer", "--bf16 --tf32 --fp16_full_eval", "run.sh")
    assert effective(imp.policy) == effective(import_from("hf_trainer", "--bf16", "run.sh").policy)
    assert "fp16_full_eval: evaluation_loop casts the model to fp16 for evaluation only" in imp.text


def test_the_4x_apex_backend_is_apex_amp():
    """transformers 4.x (huggingface/transformers@fd798335) training_args.py __post_init__ leaves
    ACCELERATE_MIXED_PRECISION unset for apex; trainer.py _wrap_model: amp.initialize(opt_level=fp16_opt_level)."""
    got = import_from("hf_trainer", "--fp16 --half_precision_backend apex --fp16_opt_level O2", "run.sh").policy
    assert effective(got) == effective(import_from("apex", "O2", "x").policy)
    out = export_to("hf_trainer", got)
    assert out.config == {"fp16": True, "half_precision_backend": "apex", "fp16_opt_level": "O2"}
    with pytest.raises(PolicyError, match="run.sh: half_precision_backend: apex with bf16"):
        import_from("hf_trainer", "--bf16 --half_precision_backend apex", "run.sh")


@pytest.mark.parametrize(("raw", "key"), [
    ("--fp16 --bf16", "bf16"),  # training_args.py _validate_args: 'At most one of fp16 and bf16'
    ({"bf16": True, "torch_dtype": "auto"}, "torch_dtype"),  # the checkpoint's dtype, known when it loads
    ("--learning_rate 1e-5", "bf16"),  # no precision setting
    ("--fp16 maybe", "fp16"),
])
def test_what_hf_refuses_or_the_file_does_not_say_is_a_located_error(raw, key):
    with pytest.raises((PolicyError, UnsupportedError)) as e:
        import_from("hf_trainer", raw, "run.sh")
    assert f"run.sh: {key}:" in str(e.value)


def test_export_cli_writes_the_arguments_and_strict_fails_on_what_they_cannot_hold(tmp_path, capsys):
    args = tmp_path / "args.json"
    args.write_text('{"fp16": true, "learning_rate": 2e-05, "output_dir": "out"}')
    assert main(["export", "mixed_bf16", "--to", "hf_trainer", "--into", str(args)]) == 0
    out = capsys.readouterr().out
    assert '"bf16": true' in out and '"learning_rate": 2e-05' in out and '"fp16"' not in out
    assert main(["export", "fp16_master", "--to", "hf_trainer", "--strict"]) == 1  # fp16 params with fp32 masters
    assert "hf_trainer cannot express" in capsys.readouterr().err
