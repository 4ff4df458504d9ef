"""`unimp import` on real third-party files, kept verbatim in tests/fixtures/real_configs/<system>/.

Each system's SOURCES.toml names every file's repository, path and commit and the numerics its own
system runs for it (``expect``), each fact citing that system's code (``cite``: file::function).
This test asserts, per file: the imported policy has those facts; nothing in the source is dropped
silently (every key it holds is in the policy file, as a source comment or in the ignored list);
import -> export -> import is the identity where the system can hold the policy; a file the
importer must decline is a located message (``error`` / ``refused``), never a policy.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import unimp
from unimp.cli import main
from unimp.errors import UnimpWarning
from unimp.migrate import export_to, import_from
from unimp.migrate.corpus import entries, imported, pasted
from unimp.migrate.export_check import effective
from unimp.policy.loading import read_file

ROOT = Path(__file__).parent / "fixtures" / "real_configs"
SYSTEMS = ("lightning", "torch", "keras", "tf_keras", "paddle", "jmp", "flax")
HEX40 = re.compile(r"^[0-9a-f]{40}$")


def _configs() -> list[tuple[str, dict[str, Any]]]:
    return [(e["system"], e) for system in SYSTEMS for e in entries(ROOT, system)]


CONFIGS = _configs()


def _id(item: tuple[str, dict[str, Any]]) -> str:
    system, c = item
    return f"{system}:{c['file']}" + (f":{c['lines']}".replace(" ", "") if "lines" in c else "")


def _source(system: str, c: dict[str, Any]) -> str:
    return pasted(ROOT, c)


def test_the_corpus_is_real_and_large_enough():
    assert len({(s, c["file"]) for s, c in CONFIGS}) >= 25
    for system, c in CONFIGS:
        assert (ROOT / system / c["file"]).is_file(), c["file"]
        assert HEX40.match(c["commit"]) and "/" in c["repository"] and c["path"], c
        assert c.get("cite") and all(isinstance(x, str) and ("::" in x or "." in x) for x in c["cite"]), c["file"]
        assert ("expect" in c) != ("error" in c or "refused" in c), c["file"]


@pytest.mark.parametrize("item", CONFIGS, ids=_id)
def test_real_config_imports_to_what_its_system_runs(item, tmp_path, capsys):
    system, c = item
    out = tmp_path / "policy.toml"
    rc = main(["import", _source(system, c), "--from", system, "-o", str(out)])  # warnings go to stderr
    captured = capsys.readouterr()
    if "expect" not in c:
        assert rc == 1 and not out.exists(), captured
        assert c.get("error", c.get("refused")) in captured.err and "Traceback" not in captured.err, captured.err
        return
    assert rc == 0, captured.err
    if "warns" in c:
        assert c["warns"] in captured.err, captured.err
    policy = unimp.load(str(out))
    facts = _facts(policy)
    expect = c["expect"]
    got = {k: facts[k] for k in expect if k != "loss_scale"}
    assert got == {k: v for k, v in expect.items() if k != "loss_scale"}
    ls = expect.get("loss_scale")
    if ls == "none":
        assert policy.loss_scale.mode == "none"
    elif ls is not None:
        assert {k: getattr(policy.loss_scale, k) for k in ls} == ls
    _nothing_dropped(system, c, out.read_text())


def _facts(policy: unimp.Policy) -> dict[str, Any]:
    return {"compute_dtype": policy.compute_dtype, "param_dtype": policy.param_dtype,
            "master_weights": policy.master_weights.enabled, "reduce_dtype": policy.distributed.reduce_dtype,
            "output_dtype": policy.output_dtype, "fp8": policy.fp8.enabled,
            "fp8_recipe": policy.fp8.recipe if policy.fp8.enabled else None}


SECTIONS = ("trainer", "runtime", "AMP")  # sections whose every key the importers read or list


def _nothing_dropped(system: str, c: dict[str, Any], text: str) -> None:
    """Every key of a config file is named in the policy file (a source comment or the ignored list)."""
    if "lines" in c:
        return
    raw = read_file(ROOT / system / c["file"]) if (ROOT / system / c["file"]).suffix in (
        ".yaml", ".yml", ".json") else None
    if not isinstance(raw, dict):
        return
    for key, value in raw.items():
        if key in SECTIONS and isinstance(value, dict) and f"{key} (" not in text:
            for child in value:
                assert f"{key}.{child}" in text, f"{key}.{child} is not in the policy file"
        elif key == "model" and isinstance(value, dict) and "model (" not in text:
            for child in value:
                assert f"model.{child}" in text, f"model.{child} is not in the policy file"
        else:
            assert re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text), f"{key} is not in the policy file"


@pytest.mark.parametrize("item", [i for i in CONFIGS if "expect" in i[1]], ids=_id)
def test_import_export_import_is_the_identity_where_the_system_holds_it(item):
    system, c = item
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        first = imported(ROOT, c).policy
        out = export_to(system, first)
        if c.get("roundtrip", True) is not True:  # a reason the system cannot hold this policy
            assert out.unexpressed, "listed as not held, but nothing was unexpressed"
            with pytest.raises(unimp.UnsupportedError):
                export_to(system, first, strict=True)
            return
        assert out.unexpressed == (), out.unexpressed
        again = import_from(system, out.config).policy
    assert effective(again) == effective(first)


@pytest.mark.parametrize(("raw", "facts"), [
    # fabric/strategies/deepspeed.py::_format_precision_config: fp16 {enabled, loss_scale 0, initial_scale_power 16,
    # loss_scale_window 1000, hysteresis 2, min_loss_scale 1}; DeepSpeed engine.py module.half(), ZeRO DynamicLossScaler
    ('Trainer(precision="16-mixed", strategy="deepspeed_stage_3")',
     {"param_dtype": "float16", "output_dtype": "float16", "reduce_dtype": "float16", "initial": 65536.0,
      "hysteresis": 2, "at_min": "error"}),
    ({"trainer": {"precision": "bf16-mixed", "strategy": {"_target_": "lightning.pytorch.strategies.DeepSpeedStrategy",
                                                          "stage": 1}}},
     {"param_dtype": "bfloat16", "output_dtype": "bfloat16", "reduce_dtype": "bfloat16", "mode": "none"}),
    # plugins/precision/fsdp.py::FSDPPrecision.mixed_precision_config: param_dtype float32, reduce_dtype the low dtype
    ('Trainer(precision="bf16-mixed", strategy="fsdp")',
     {"param_dtype": "float32", "compute_dtype": "bfloat16", "reduce_dtype": "bfloat16", "mode": "none"}),
    ({"trainer": {"precision": "16-mixed", "strategy": {"_target_": "lightning.pytorch.strategies.FSDPStrategy"}}},
     {"param_dtype": "float32", "compute_dtype": "float16", "reduce_dtype": "float16", "initial": 65536.0}),
    ('Trainer(precision="bf16-mixed", strategy="ddp")', {"param_dtype": "float32", "reduce_dtype": "float32"}),
])
def test_lightning_strategy_decides_who_runs_the_precision(raw, facts):
    """A DeepSpeed strategy hands the precision to DeepSpeed (whole model in the low dtype, its
    scaler); an FSDP strategy reduces in the low dtype; DDP keeps float32 gradients."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        p = import_from("lightning", raw, "t").policy
    got = {"param_dtype": p.param_dtype, "output_dtype": p.output_dtype, "reduce_dtype": p.distributed.reduce_dtype,
           "compute_dtype": p.compute_dtype, "initial": p.loss_scale.initial, "hysteresis": p.loss_scale.hysteresis,
           "at_min": p.loss_scale.at_min, "mode": p.loss_scale.mode}
    assert {k: got[k] for k in facts} == facts


def test_lightning_deepspeed_strategy_with_its_own_config_points_at_it():
    raw = {"trainer": {"precision": 16, "strategy": {"_target_": "lightning.pytorch.strategies.DeepSpeedStrategy",
                                                     "config": "ds.json"}}}
    with pytest.raises(unimp.UnsupportedError, match=r"t: trainer.strategy.config: .*--from deepspeed"):
        import_from("lightning", raw, "t")


@pytest.mark.parametrize(("plugin", "facts"), [
    # nemo/lightning/pytorch/plugins/mixed_precision.py::MegatronMixedPrecision.__init__ defaults:
    # fp16_initial_loss_scale 2**32, fp16_min_loss_scale 1, fp16_loss_scale_window 1000, fp16_hysteresis 2,
    # grad_reduce_in_fp32 True
    ({"precision": "16-mixed"}, {"param_dtype": "float16", "reduce_dtype": "float32", "initial": 4294967296.0,
                                 "growth_interval": 1000, "hysteresis": 2, "min": 1.0, "mode": "dynamic"}),
    ({"precision": "16-mixed", "fp16_loss_scale": 1024}, {"mode": "static", "initial": 1024.0}),
    ({"precision": "bf16-mixed", "grad_reduce_in_fp32": False}, {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16",
                                                                 "mode": "none"}),
    ({"precision": "32"}, {"param_dtype": "float32", "mode": "none"}),
])
def test_nemo2_megatron_mixed_precision_plugin(plugin, facts):
    raw = {"trainer": {"devices": 1}, "plugins": {"_target_": "nemo.lightning.MegatronMixedPrecision", **plugin}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnimpWarning)
        p = import_from("lightning", raw, "t").policy
    got = {"param_dtype": p.param_dtype, "reduce_dtype": p.distributed.reduce_dtype, "initial": p.loss_scale.initial,
           "growth_interval": p.loss_scale.growth_interval, "hysteresis": p.loss_scale.hysteresis,
           "min": p.loss_scale.min, "mode": p.loss_scale.mode}
    assert {k: got[k] for k in facts} == facts


def test_nemo2_plugin_and_a_trainer_precision_conflict():
    raw = {"trainer": {"precision": "bf16-mixed"}, "plugins": {"_target_": "nemo.lightning.MegatronMixedPrecision",
                                                               "precision": "bf16-mixed"}}
    with pytest.raises(unimp.PolicyError, match="t: trainer.precision: given together with plugins"):
        import_from("lightning", raw, "t")


def test_paddle_fleet_lines_pasted_as_written():
    """fleet: ``strategy.amp = True; strategy.amp_configs = {...}`` (DistributedStrategy) pasted verbatim
    imports as the amp_configs dict; ``strategy.amp = False`` says fleet runs float32."""
    text = ('strategy = fleet.DistributedStrategy()\nstrategy.amp = True\n'
            'strategy.amp_configs = {"init_loss_scaling": 1024, "custom_white_list": ["softmax"]}')
    p = import_from("paddle", text, "t").policy
    assert p.loss_scale.initial == 1024.0 and p.compute_dtype == "float16" and p.ops.category("softmax") == "lower"
    with pytest.raises(unimp.PolicyError, match="t: strategy.amp: False"):
        import_from("paddle", text.replace("amp = True", "amp = False"), "t")


@pytest.mark.parametrize("line", ["paddle.static.amp.decorate(optimizer, use_fp16_guard=True)",
                                  "opt = paddle.fluid.contrib.mixed_precision.decorate(opt, init_loss_scaling=128.0)"])
def test_paddle_static_decorate_is_refused_with_the_fleet_form(line):
    """static.amp.decorate is not paddle.amp.decorate (its arguments and two overloads' defaults differ,
    python/paddle/static/amp/decorator.py): a located refusal whose fix command itself imports."""
    with pytest.raises(unimp.UnsupportedError) as e:
        import_from("paddle", line, "t")
    assert "static-graph decorate" in str(e.value)
    fix = re.search(r"`unimp import '(.*)' --from paddle`", str(e.value)).group(1)
    assert import_from("paddle", fix, "t").policy.loss_scale.initial == 32768.0


def test_lightning_on_tpu_is_refused_with_why():
    """fabric/plugins/precision/xla.py XLAPrecision: 16-true / bf16-true set XLA_USE_F16 / XLA_USE_BF16
    (every float32 tensor held low, optimizer state included); '-mixed' is not an XLA precision."""
    with pytest.raises(unimp.UnsupportedError, match="t: accelerator: 'tpu' with bf16-true: XLAPrecision"):
        import_from("lightning", 'Trainer(precision="bf16-true", accelerator="tpu")', "t")
    assert import_from("lightning", 'Trainer(precision="32-true", accelerator="tpu")', "t").policy.param_dtype == \
        "float32"


def test_nemo2_plugin_dtype_arguments_as_its_recipes_write_them():
    """nemo/collections/llm/recipes/precision/mixed_precision.py bf16_mixed(): params_dtype and
    pipeline_dtype torch.bfloat16: the same Float16Module run; another dtype is refused."""
    plugin = {"_target_": "nemo.lightning.MegatronMixedPrecision", "precision": "bf16-mixed",
              "params_dtype": "torch.bfloat16", "pipeline_dtype": "torch.bfloat16", "autocast_enabled": False}
    p = import_from("lightning", {"trainer": {"devices": 1}, "plugins": plugin}, "t").policy
    assert (p.param_dtype, p.distributed.reduce_dtype) == ("bfloat16", "float32")
    with pytest.raises(unimp.UnsupportedError, match="t: plugins.params_dtype"):
        import_from("lightning", {"trainer": {}, "plugins": {**plugin, "params_dtype": "torch.float16"}}, "t")
