"""Real DeepSpeed / apex / Accelerate / Megatron configurations, kept verbatim in
``tests/fixtures/real_configs/<system>/`` (repository, path and commit in each SOURCES.toml), import to
the numerics their own system runs.

The expected facts (compute / param / output dtype, fp32 masters, reduce dtype, the loss-scale rule,
the FP8 recipe) are written in SOURCES.toml from the source system's code, each with a citation
(file + function) in its ``[cite.*]`` table; they are never computed by unimp. A file that holds
no precision setting, or a value only known at run time, must be a located error naming the key.
Every import must also come back unchanged through that system's export (import -> export ->
import), or the export must list what the system cannot hold.
"""

from __future__ import annotations

import json
import pathlib
import tomllib
import warnings

import pytest

from unimp.cli import _read_source, main
from unimp.errors import PolicyError, UnimpWarning, UnsupportedError
from unimp.migrate import export_to, import_from
from unimp.migrate.export_check import effective
from unimp.policy.loading import load
from unimp.policy.resolve import parse_text

ROOT = pathlib.Path(__file__).with_name("fixtures") / "real_configs"
SYSTEMS = ("deepspeed", "apex", "accelerate", "megatron", "neox")
SOURCES = {s: tomllib.loads((ROOT / s / "SOURCES.toml").read_text()) for s in SYSTEMS}
ENTRIES = [(s, f) for s in SYSTEMS for f in SOURCES[s]["file"]]
FACTS = ("compute_dtype", "param_dtype", "masters", "reduce_dtype", "output_dtype", "loss_scale", "float32_ops", "fp8")


def _import(system: str, entry: dict):
    raw, source = _read_source(str(ROOT / system / entry["name"]), system)  # as `unimp import FILE` reads it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        return import_from(system, raw, source, entry.get("assume"))


def _facts(policy) -> dict:
    ls = policy.loss_scale
    rule = {"mode": ls.mode}
    if ls.mode != "none":
        rule["initial"] = ls.initial
    if ls.mode == "dynamic":
        rule.update(growth_interval=ls.growth_interval, hysteresis=ls.hysteresis, min=ls.min, at_min=ls.at_min)
    f = policy.fp8
    return {"compute_dtype": policy.compute_dtype, "param_dtype": policy.param_dtype,
            "masters": policy.master_weights.enabled and policy.param_dtype != "float32",
            "reduce_dtype": policy.distributed.reduce_dtype, "output_dtype": policy.output_dtype, "loss_scale": rule,
            "float32_ops": sorted(policy.ops.float32),
            "fp8": {"enabled": True, "recipe": f.recipe, "amax_history": f.amax_history,
                    "forward_format": f.forward_format, "gradient_format": f.gradient_format} if f.enabled else None}


def test_the_corpus_is_what_the_sources_say():
    """Every file is listed with its repository, a 40-hex commit and a citation for each fact; at
    least 40 files over the four systems, each system with a DeepSpeed-style error case or more."""
    for system in SYSTEMS:
        listed = {e["name"] for e in SOURCES[system]["file"]}
        assert listed == {p.name for p in (ROOT / system).iterdir() if p.name != "SOURCES.toml"}
        for e in SOURCES[system]["file"]:
            assert len(e["commit"]) == 40 and int(e["commit"], 16) >= 0 and "/" in e["repository"]
            cite = SOURCES[system]["cite"][e["cite"]]
            assert all(cite.get(k) for k in FACTS if k in e and k not in ("float32_ops",)), e["name"]
    assert len(ENTRIES) >= 40


@pytest.mark.parametrize(("system", "entry"), ENTRIES, ids=lambda v: v["name"] if isinstance(v, dict) else v)
def test_a_real_config_imports_to_what_its_system_runs(system, entry):
    if "error" in entry:  # no precision setting, or a run-time value: a located error, never a policy
        with pytest.raises((PolicyError, UnsupportedError)) as e:
            _import(system, entry)
        assert f": {entry['error']}:" in str(e.value), str(e.value)
        return
    imp = _import(system, entry)
    assert load(parse_text(imp.text, "toml")).fingerprint == imp.policy.fingerprint  # the file is what was read
    got = _facts(imp.policy)
    want = {k: entry[k] for k in FACTS if k in entry}
    want.setdefault("fp8", None)
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize(("system", "entry"), [e for e in ENTRIES if "error" not in e[1]],
                         ids=lambda v: v["name"] if isinstance(v, dict) else v)
def test_import_export_import_keeps_the_policy_or_lists_why(system, entry):
    first = _import(system, entry)
    out = export_to(system, first.policy)
    lost = [u for u in out.unexpressed if not u.startswith(("zero_optimization.stage = ",
                                                            "deepspeed_config.zero_stage = "))]
    if lost:  # the system's own arguments cannot hold it: listed, and --strict refuses
        assert entry.get("identity") is False or (system == "megatron" and entry["cite"].startswith("meg_ds")), lost
        with pytest.raises(UnsupportedError):
            export_to(system, first.policy, strict=True)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        again = import_from(system, out.config, "re-import")
    assert effective(again.policy) == effective(first.policy)


@pytest.mark.parametrize(("system", "entry"), [e for e in ENTRIES if "error" not in e[1]],
                         ids=lambda v: v["name"] if isinstance(v, dict) else v)
def test_no_key_is_dropped_silently(system, entry):
    """Each source key is mapped (a commented policy key), listed as not a precision setting, or
    noted with its reason in the file's header."""
    imp = _import(system, entry)
    path = ROOT / system / entry["name"]
    if path.suffix in (".json", ".yaml", ".yml"):
        raw, _ = _read_source(str(path))
        header = "\n".join(line for line in imp.text.splitlines() if line.startswith("#"))
        body = imp.text
        for key in raw:
            assert key in imp.ignored or key in body or key in header or any(i.startswith(f"{key}.") for i in
                                                                             imp.ignored), key
            whole = any(line.startswith(f"# {key}") and "not held" in line for line in header.splitlines())
            if isinstance(raw[key], dict) and key not in imp.ignored and not whole:  # a section read: each key too
                for sub in raw[key]:
                    assert f"{key}.{sub}" in imp.ignored or sub in body, f"{key}.{sub}"
    else:  # a launch script / code line: every argument is read or listed (and the DeepSpeed JSON it writes)
        assert all(word.startswith("--") or "--deepspeed_config" in imp.text for word in imp.ignored)
    ignored_line = next((line for line in imp.text.splitlines() if line.startswith("# Not precision")), "")
    assert all(word in ignored_line for word in imp.ignored)  # the file the user reads lists each one


def test_the_zero_stage_is_listed_not_rewritten(capsys):
    """A ZeRO-3 file exports stage 1 only as the lowest stage running its loss scaler, and says so:
    --strict fails on it."""
    entry = next(e for s, e in ENTRIES if e["name"] == "dse_autotuning_fp16_z3.json")
    policy = _import("deepspeed", entry).policy
    out = export_to("deepspeed", policy)
    assert out.config["zero_optimization"] == {"stage": 1}
    assert any(u.startswith("zero_optimization.stage = 1: the policy holds no ZeRO stage") for u in out.unexpressed)
    with pytest.raises(UnsupportedError, match="zero_optimization.stage"):
        export_to("deepspeed", policy, strict=True)


def test_every_preset_exports_to_every_system_or_says_why():
    from unimp.policy.loading import preset_names

    for system in SYSTEMS:
        for name in preset_names():
            out = export_to(system, name)
            assert out.text.strip() and all(": " in u for u in out.unexpressed), (system, name)
    out = export_to("megatron", "fp32")  # no precision argument: float32; nothing lost
    assert out.unexpressed == () and "float32" in out.text


def test_auto_needs_the_trainer_arguments(tmp_path, capsys):
    """HF Trainer's "auto" (transformers integrations/deepspeed.py HfTrainerDeepSpeedConfig.
    trainer_config_process): without the Trainer's arguments a located error with the fix; with
    them, fp16.enabled = fp16 with the amp backend, bf16.enabled = bf16."""
    path = str(ROOT / "deepspeed" / "hf_ds_config_zero2.json")
    assert main(["import", path, "--from", "deepspeed"]) == 1
    err = capsys.readouterr().err
    assert ': fp16.enabled: "auto"' in err and "--assume fp16=true" in err and "Traceback" not in err
    assert main(["import", path, "--from", "deepspeed", "--assume", "fp16=true"]) == 0
    assert 'extends = "deepspeed_zero_fp16"' in capsys.readouterr().out
    args = tmp_path / "training_args.json"
    args.write_text(json.dumps({"fp16": False}))  # Trainer's fp16=False: DeepSpeed runs float32
    assert main(["import", path, "--from", "deepspeed", "--assume", str(args)]) == 0
    assert 'extends = "fp32"' in capsys.readouterr().out
    # the apex backend: fill_match("fp16.enabled", ... and fp16_backend == "amp") gives false (the file has no
    # "amp" section for amp.enabled): HfTrainerDeepSpeedConfig's dtype is then float32
    assert main(["import", path, "--from", "deepspeed", "--assume", "fp16=true", "--assume",
                 "fp16_backend=apex"]) == 0
    assert 'extends = "fp32"' in capsys.readouterr().out
    assert main(["import", path, "--from", "deepspeed", "--assume", "fp16=maybe"]) == 1
    err = capsys.readouterr().err
    assert "--assume fp16" in err and "Traceback" not in err


def test_the_trainer_precision_adds_the_section_the_file_lacks(capsys):
    """HF Trainer hands its precision to Accelerate (transformers training_args.py __post_init__:
    ACCELERATE_MIXED_PRECISION); accelerate utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision
    adds ``bf16: {enabled: true}`` (or ``fp16: {enabled: true, auto_cast: true}``) when the config has
    no such section. HF's zero3 file has only an fp16 "auto" section: with bf16=true it trains bf16,
    never float32; the other section enabled is Accelerate's ValueError."""
    path = str(ROOT / "deepspeed" / "hf_ds_config_zero3.json")
    assert main(["import", path, "--from", "deepspeed", "--assume", "bf16=true"]) == 0
    out = capsys.readouterr().out
    assert 'extends = "deepspeed_bf16"' in out and "DeepSpeedPlugin.set_mixed_precision" in out
    policy = import_from("deepspeed", {"zero_optimization": {"stage": 2}}, "x", {"fp16": "true"}).policy
    assert (policy.param_dtype, policy.loss_scale.mode, policy.loss_scale.hysteresis) == ("float16", "dynamic", 2)
    with pytest.raises(PolicyError, match="x: bf16.enabled: "):  # HF's mismatch check, or Accelerate's
        import_from("deepspeed", {"bf16": {"enabled": True}}, "x", {"fp16": "true"})


def test_a_file_value_the_trainer_arguments_contradict_is_refused_as_hf_refuses_it():
    """HfTrainerDeepSpeedConfig.fill_match (transformers integrations/deepspeed.py): a value that is
    not "auto" must equal the Trainer's, else trainer_config_finalize raises. LLaMA-Factory's fp8 file
    has fp16.enabled false: with fp16=true HF refuses the run (it never trains float32)."""
    raw = {"fp16": {"enabled": False}, "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
    with pytest.raises(PolicyError, match=r"x: fp16.enabled: False while the Trainer arguments give True"):
        import_from("deepspeed", raw, "x", {"fp16": "true"})
    assert import_from("deepspeed", raw, "x", {"bf16": "true"}).policy.param_dtype == "bfloat16"
    with pytest.raises(PolicyError, match=r"x: bf16.enabled: True while the Trainer arguments give False"):
        import_from("deepspeed", {"bf16": {"enabled": True}}, "x", {"fp16": "false"})
    assert import_from("deepspeed", {"fp16": {"enabled": False}}, "x", {"bf16": "false"}).policy.param_dtype == \
        "float32"


def test_every_command_of_the_migration_guide_runs(tmp_path, monkeypatch, capsys):
    """docs/migrating_ds.md: each `unimp import ... --from X` runs on the corpus file it names."""
    import re
    import shlex
    import shutil

    guide = (ROOT.parents[2] / "docs" / "migrating_ds.md").read_text()
    files = {"ds_config.json": "deepspeed/dse_autotuning_fp16_z2.json",
             "ds_config_zero2.json": "deepspeed/hf_ds_config_zero2.json", "fsdp.yaml": "accelerate/templates_fsdp.yaml",
             "train_gpt3_175b_distributed.sh": "megatron/megatron_train_gpt3_175b_distributed.sh",
             "125M.yml": "neox/125M.yml"}
    for name, corpus in files.items():
        shutil.copy(ROOT / corpus, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    commands = re.findall(r"`(unimp import (?:[^`]|`[^`]*`)*?--from \w+(?: --assume \S+)?)`", guide)
    assert {c.split("--from ")[1].split()[0] for c in commands} == set(SYSTEMS) and len(commands) >= 7
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, (command, capsys.readouterr().err)


@pytest.mark.parametrize(("system", "raw", "key"), [
    ("deepspeed", {"train_batch_size": 8, "zero_optimization": {"stage": 2}}, "fp16"),
    ("accelerate", "Accelerator()", "mixed_precision"),
    ("accelerate", {"distributed_type": "MULTI_GPU", "num_processes": 2}, "mixed_precision"),
    ("apex", {}, "opt_level"),
    ("megatron", "torchrun pretrain_gpt.py --micro-batch-size 4 --num-layers 2", "--fp16"),
])
def test_an_input_without_a_precision_setting_is_an_error(system, raw, key):
    """Never a float32 policy by default: the error says the input holds no precision setting."""
    with pytest.raises(PolicyError) as e:
        import_from(system, raw, "input")
    assert f"input: {key}:" in str(e.value) and ("no precision" in str(e.value) or "not given" in str(e.value))


@pytest.mark.parametrize("entry", [e for s, e in ENTRIES if s == "apex" and e.get("loss_scale", {}).get("mode") ==
                                   "dynamic"], ids=lambda e: e["name"])
def test_apex_loss_scaler_replays_the_imported_policy(entry):
    """apex cannot be installed: its LossScaler transcribed line by line (test_loss_scale_systems.py
    ApexLossScaler, apex/amp/scaler.py), built with amp.initialize's defaults for the arguments the
    file leaves out (min_loss_scale=None, max_loss_scale=2.**24: apex/amp/frontend.py initialize)."""
    from test_loss_scale_systems import ApexLossScaler

    from unimp.conformance.loss_scale import reference, sequences

    spec = _import("apex", entry).policy.loss_scale
    for seq in [*sequences(3, 200, 3000, seed=5), [True] * 18500]:  # the last one grows to the cap, 2**24
        real, want = ApexLossScaler(), reference(spec, seq)
        for i, finite in enumerate(seq):
            real._has_overflow = not finite
            assert real.update_scale() == want.skips[i] and real._loss_scale == want.scales[i], (entry["name"], i)
        assert max(want.scales) <= 2.0 ** 24


@pytest.mark.parametrize(("script", "facts"), [
    ('GPT_ARGS="--fp16 --loss-scale 12" --micro-batch-size 4',  # the example: a quoted variable
     {"compute_dtype": "float16", "loss_scale": {"mode": "static", "initial": 12.0}}),
    ('ARGS=(\n    --bf16\n    --grad-reduce-in-bf16  # reduce in bf16\n)\ntorchrun pretrain_gpt.py "${ARGS[@]}"',
     {"compute_dtype": "bfloat16", "reduce_dtype": "bfloat16", "loss_scale": {"mode": "none"}}),
    ("LS=2048\npython pretrain_gpt.py \\\n  --fp16 \\\n  --initial-loss-scale $LS \\\n  --hysteresis 3",
     {"loss_scale": {"mode": "dynamic", "initial": 2048.0, "growth_interval": 1000, "hysteresis": 3, "min": 1.0,
                     "at_min": "clamp"}}),
])
def test_megatron_reads_a_launch_script_as_the_shell_does(script, facts):
    got = _facts(import_from("megatron", script, "run.sh").policy)
    assert {k: got[k] for k in facts} == facts


@pytest.mark.parametrize(("script", "key"), [
    ("--fp16 --deepspeed --deepspeed_config ds.json", "--deepspeed_config"),  # not written by the script
    ("--bf16 --fp8-format hybrid --fp8-recipe mxfp8", "--fp8-recipe"),
    ("--bf16 --fp8-format hybrid --fp8-wgrad", "--fp8-wgrad"),
    ("--fp16 --loss-scale $SCALE", "--loss-scale"),  # a variable the script does not assign
    ("--fp16 --loss-scale 8 --loss-scale 16", "--loss-scale"),
])
def test_megatron_refuses_what_it_cannot_read_with_the_argument(script, key):
    with pytest.raises((PolicyError, UnsupportedError)) as e:
        import_from("megatron", script, "run.sh")
    assert f"run.sh: {key}:" in str(e.value)


def test_megatron_precision_arguments_unimp_cannot_hold_are_refused_or_noted():
    with pytest.raises(UnsupportedError, match="run.sh: --exp-avg-dtype: 'bf16': unimp keeps Adam's first moment"):
        import_from("megatron", "--bf16 --use-precision-aware-optimizer --exp-avg-dtype bf16", "run.sh")
    with pytest.warns(UnimpWarning, match="--first-last-layers-bf16"):
        imp = import_from("megatron", "--bf16 --fp8-format e4m3 --fp8-recipe tensorwise --first-last-layers-bf16",
                          "run.sh")
    assert "# --first-last-layers-bf16: the first/last transformer layers stay bf16" in imp.text
    assert imp.policy.fp8.recipe == "tensorwise" and imp.policy.fp8.gradient_format == "e4m3"


@pytest.mark.parametrize(("config", "key"), [
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
     "zero_optimization.zero_quantized_weights"),
    ({"bf16": {"enabled": True}, "msamp": {"enabled": True, "opt_level": "O2"}}, "msamp.enabled"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
     "fp16.fp16_master_weights_and_grads"),
    ({"fp16": {"enabled": True}, "communication_data_type": "int8"}, "communication_data_type"),
    ({"fp16": {"enabled": True}, "amp": {"enabled": True}}, "amp.enabled"),  # engine.py: amp with fp16 raises
])
def test_deepspeed_settings_unimp_cannot_hold_are_refused_with_the_key(config, key):
    with pytest.raises((PolicyError, UnsupportedError)) as e:
        import_from("deepspeed", config, "ds.json")
    assert f"ds.json: {key}:" in str(e.value)


def test_deepspeed_amp_section_is_apex():
    """engine.py _configure_optimizer: "amp": {"enabled": true, ...} calls apex.amp.initialize(**amp_params)."""
    got = import_from("deepspeed", {"amp": {"enabled": True, "opt_level": "O2"}}, "ds.json").policy
    assert effective(got) == effective(import_from("apex", "O2").policy)


@pytest.mark.parametrize(("raw", "facts"), [
    # accelerator.py Accelerator.__init__: bf16 native_amp on device 'cpu'; get_mixed_precision_context_manager:
    # torch.autocast(device_type=state.device.type) -> the CPU op lists
    ({"distributed_type": "MULTI_CPU", "mixed_precision": "bf16"}, {"extends_cpu": True, "param_dtype": "float32"}),
    ({"distributed_type": "NO", "use_cpu": True, "mixed_precision": "bf16"}, {"extends_cpu": True}),
    # native_amp is off for MEGATRON_LM; utils/dataclasses.py MegatronLMPlugin.set_mixed_precision sets args fp16/bf16
    ({"distributed_type": "MEGATRON_LM", "mixed_precision": "bf16"},
     {"param_dtype": "bfloat16", "output_dtype": "float32", "reduce_dtype": "float32", "masters": True}),
    ({"distributed_type": "MEGATRON_LM", "mixed_precision": "fp16"},
     {"param_dtype": "float16", "output_dtype": "float32", "masters": True}),
])
def test_accelerate_device_and_megatron_decide_the_numerics(raw, facts):
    imp = import_from("accelerate", raw, "a.yaml")
    p = imp.policy
    got = {"extends_cpu": 'extends = "torch_autocast_cpu"' in imp.text, "param_dtype": p.param_dtype,
           "output_dtype": p.output_dtype, "reduce_dtype": p.distributed.reduce_dtype,
           "masters": p.master_weights.enabled}
    assert {k: got[k] for k in facts} == facts


def test_accelerate_fp16_on_cpu_is_refused_with_why():
    with pytest.raises(UnsupportedError, match="a.yaml: mixed_precision: 'fp16' on CPU"):
        import_from("accelerate", {"distributed_type": "MULTI_CPU", "mixed_precision": "fp16"}, "a.yaml")


def test_megatron_precision_from_a_variable_the_script_does_not_set_is_located():
    """``--${PRECISION}`` with PRECISION unassigned is set at launch: never 'float32' by default."""
    with pytest.raises(PolicyError, match=r"s.sh: --\$\{PRECISION\}: no --fp16 / --bf16 written out"):
        import_from("megatron", "torchrun pretrain_gpt.py --${PRECISION} --micro-batch-size 2", "s.sh")
    imp = import_from("megatron", "export PRECISION=fp16\ntorchrun pretrain_gpt.py --$PRECISION", "s.sh")
    assert imp.policy.param_dtype == "float16"
