"""Lightning (``Trainer`` / ``Fabric``) and NeMo's Megatron trainer: ``precision``, both directions.

Read as Lightning reads it (Lightning-AI/pytorch-lightning):

- values: ``src/lightning/fabric/plugins/precision/precision.py`` (``_PRECISION_INPUT``: 64, 32, 16,
  "64", "32", "16", "bf16" and the "-true"/"-mixed"/"transformer-engine" strings) and
  ``fabric/connector.py::_convert_precision_to_unified_args`` (aliases "16" -> "16-mixed",
  "bf16" -> "bf16-mixed", "32" -> "32-true", "64" -> "64-true");
- plugins: ``pytorch/trainer/connectors/accelerator_connector.py::_check_and_init_precision``:
  "16-mixed"/"bf16-mixed" -> ``MixedPrecision(precision, device)`` with device "cpu" when
  ``accelerator="cpu"`` (and "16-mixed" on CPU becomes "bf16-mixed"), else "cuda";
  ``pytorch/plugins/precision/amp.py::MixedPrecision.__init__``: "16-mixed" gets
  ``torch.amp.GradScaler(device=device)`` (its defaults), "bf16-mixed" no scaler;
  ``plugins/precision/half.py::HalfPrecision``: "-true" converts the module (``module.to(dtype)``),
  no autocast, no scaler, no float32 copy; Fabric's ``HalfPrecision.convert_output`` casts outputs
  back to float32, the Trainer's keeps them; ``fabric/plugins/precision/transformer_engine.py``:
  "transformer-engine(-float16)" converts the module to bfloat16 (float16), runs
  ``torch.autocast("cuda", weights dtype)`` around ``te.fp8_autocast(DelayedScaling())`` (FP8 Linear
  layers whose dims are multiples of 8/16), no scaler, outputs cast to float32.
- where: a ``precision`` key at the top (a Trainer/Fabric kwargs file, litgpt's config_hub) or under
  ``trainer:`` (NeMo, composed hydra configs); ``Trainer(precision=...)`` / ``Fabric(...)`` lines.
- NeMo (NVIDIA/NeMo ``nemo/collections/nlp/parts/megatron_trainer_builder.py::_plugins`` and
  ``_grad_scaler``, ``nlp_overrides.py::GradScaler``/``MegatronHalfPrecisionPlugin``): with a
  ``model:`` section holding NeMo's precision keys, fp16 uses NeMo's GradScaler(init_scale=
  native_amp_init_scale (2**32), growth_interval=native_amp_growth_interval (1000), hysteresis (2)),
  the hysteresis refilled on every finite step; ``megatron_amp_O2`` keeps half parameters with
  float32 main parameters in the optimizer (fp16: float16 gradient accumulation, bf16: float32).

>>> import_policy("bf16-true").policy.param_dtype
'bfloat16'
>>> from_cli({"trainer": {"precision": 16}}, "t.yaml").policy.loss_scale.initial
65536.0
>>> export_policy(import_policy("16-mixed").policy).config
'16-mixed'
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from unimp.migrate import torch as torch_amp
from unimp.migrate.draft import Draft, Exported, Imported
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import calls
from unimp.migrate.values import bad, flag, number, refuse, text
from unimp.policy import Policy
from unimp.policy.loading import load
from unimp.policy.spec import short

SYSTEM = "lightning"
ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "transformer-engine",
              "transformer-engine-float16")
TRAINERS = ("Trainer", "Fabric")
LITGPT_KEYS = ("checkpoint_dir", "quantize", "out_dir")  # litgpt/finetune/*.py, litgpt/pretrain.py setup()
# NeMo model keys that decide numerics (nemo/collections/nlp/parts/megatron_trainer_builder.py and
# examples/nlp/language_modeling/conf/megatron_gpt_config.yaml "# Mixed precision" block)
NEMO_KEYS = ("megatron_amp_O2", "native_amp_init_scale", "native_amp_growth_interval", "hysteresis",
             "fp32_residual_connection", "fp16_lm_cross_entropy", "fsdp", "fsdp_grad_reduce_dtype",
             "transformer_engine", "fp8", "fp8_e4m3", "fp8_hybrid", "fp8_margin", "fp8_interval",
             "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "precision")
INTERPOLATION = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")


def import_policy(precision: str | int = "32-true", *, source: str = "lightning", fabric: bool = False,
                  accelerator: str | None = None, nemo: Mapping[str, Any] | None = None) -> Imported:
    """The policy of ``Trainer(precision=precision, accelerator=accelerator)`` (``fabric``:
    ``Fabric(...)``); ``nemo`` is a NeMo config's ``model:`` section (its precision keys)."""
    return _read(precision, source, fabric, accelerator, nemo, [])


def _name(precision: Any, source: str, where: str) -> str:
    """The unified precision string (``_convert_precision_to_unified_args``)."""
    ok = isinstance(precision, str) or (isinstance(precision, int) and not isinstance(precision, bool))
    name = ALIASES.get(str(precision), str(precision)) if ok else None
    if name not in PRECISIONS or (isinstance(precision, int) and precision not in (16, 32, 64)):
        raise bad(source, where, f"{short(precision)} is not one of {', '.join(PRECISIONS)} (or 64, 32, 16, 'bf16')")
    return name


def _strategy(strategy: Any, source: str, where: str) -> tuple[str, int, dict[str, Any]]:
    """("fsdp" | "deepspeed" | "", ZeRO stage, DeepSpeedStrategy kwargs) of a Trainer/Fabric ``strategy``
    (a registry name such as "fsdp" / "deepspeed_stage_3_offload", or a hydra ``_target_`` mapping)."""
    kw: dict[str, Any] = {}
    if isinstance(strategy, Mapping):
        kw = {k: v for k, v in strategy.items() if k != "_target_"}
        name = str(strategy.get("_target_", "")).rpartition(".")[2]
        kind = {"FSDPStrategy": "fsdp", "DeepSpeedStrategy": "deepspeed"}.get(name, "")
        stage = kw.get("stage", 2)
    elif isinstance(strategy, str):
        m = re.match(r"^deepspeed(?:_stage_(\d))?", strategy)
        kind = "deepspeed" if m else "fsdp" if strategy.startswith("fsdp") else ""
        stage = int(m.group(1)) if m and m.group(1) else 2  # strategies/deepspeed.py register_strategies
    else:
        return "", 0, {}
    if kind == "deepspeed" and kw.get("config") is not None:
        raise refuse(source, f"{where}.config", "DeepSpeedStrategy(config=...) takes the precision from that DeepSpeed "
                     "config (strategies/deepspeed.py _format_precision_config fills only a missing fp16/bf16 "
                     "section)", "import that config: `unimp import ds_config.json --from deepspeed`")
    return kind, number(source, f"{where}.stage", stage, int, minimum=0), kw


# DeepSpeedStrategy defaults (lightning src/lightning/pytorch/strategies/deepspeed.py DeepSpeedStrategy.__init__)
DS_SCALER = {"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
             "min_loss_scale": 1}


def _deepspeed(name: str, said: str, stage: int, kw: Mapping[str, Any], source: str, where: str,
               ignored: list[str]) -> Imported:
    """strategy deepspeed*: DeepSpeed runs the precision. fabric/strategies/deepspeed.py
    ``_format_precision_config``: "16-mixed"/"16-true" add ``fp16`` {enabled, loss_scale, ...} with the
    strategy's scaler arguments, "bf16-*" ``bf16`` {enabled}; the engine then converts the whole model."""
    from unimp.migrate import deepspeed
    from unimp.migrate.draft import relabel

    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if name.startswith("16"):
        config["fp16"] = {"enabled": True, **{k: kw.get(k, v) for k, v in DS_SCALER.items()}}
    elif name.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    elif name == "32-true":
        config["fp16"] = {"enabled": False}
    else:
        raise refuse(source, where, f"{said} under DeepSpeed is not imported", "use 16-mixed, bf16-mixed or 32-true")
    imp = deepspeed.import_policy(config, source=f"{source}: {where} (the DeepSpeed config Lightning builds)")
    rest = [f"{where}.{k}" for k in kw if k not in (*DS_SCALER, "stage")]
    if name.startswith("bf16"):
        rest += [f"{where}.{k} (read for 16-mixed only)" for k in kw if k in DS_SCALER]
    return relabel(imp, SYSTEM, source, f"{where} DeepSpeed with {said}", tuple([*ignored, *rest]),
                   (f"{where}: DeepSpeedStrategy (stage {stage}) with {said}: strategies/deepspeed.py "
                    f"_format_precision_config writes {json_text(config)}; the engine converts the whole model",))


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def _read(precision: Any, source: str, fabric: bool, accelerator: Any, nemo: Mapping[str, Any] | None,
          ignored: list[str], where: str = "precision", bert: bool = False, strategy: Any = None) -> Imported:
    name = _name(precision, source, where)
    at = f"{where.removesuffix('precision')}strategy"
    kind, stage, skw = _strategy(strategy, source, at) if nemo is None else ("", 0, {})
    said = f"{where}={precision if isinstance(precision, int) else short(precision)}"
    if accelerator is not None:
        said += f" with {where.removesuffix('precision')}accelerator={short(accelerator)}"
    if name == "64-true":
        raise refuse(source, where, "'64-true' trains in float64, which unimp policies do not hold",
                     "use '32-true' (policy fp32)")
    device = "cuda"
    if accelerator is not None:
        acc = text(source, "accelerator", accelerator)
        if acc == "cpu":
            device = "cpu"
        elif acc == "tpu" and name != "32-true":  # accelerator_connector.py: XLAAccelerator -> XLAPrecision
            raise refuse(source, "accelerator", f"'tpu' with {name}: XLAPrecision sets XLA_USE_BF16 / XLA_USE_F16 "
                         "(fabric/plugins/precision/xla.py): XLA stores every float32 tensor, optimizer state "
                         "included, in the low dtype; unimp keeps float32 masters",
                         "import the run's GPU precision (accelerator 'gpu') or '32-true'")
        elif acc == "mps" and name.endswith("-mixed"):
            raise refuse(source, "accelerator", "'mps' autocast has its own op lists, which unimp does not hold",
                         "import with accelerator 'gpu' or 'cpu'")
    if name == "16-mixed" and device == "cpu" and not fabric:
        name, said = "bf16-mixed", f"{said} with accelerator='cpu': Lightning runs 'bf16-mixed' (fp16 AMP on CPU)"
    if nemo is not None and name in ("16-mixed", "bf16-mixed"):
        return _nemo(name, said, nemo, source, ignored, bert)
    if kind == "deepspeed":
        return _deepspeed(name, said, stage, skw, source, at, ignored)
    if nemo is not None:  # MegatronTrainerBuilder._plugins builds no precision plugin for it
        ignored = [*ignored, *(f"model.{k} (NeMo builds no precision plugin for {name})" for k in nemo)]
    if name == "32-true":
        d = Draft(SYSTEM, source, "fp32", f"{said}: full precision")
    elif name.startswith("transformer-engine"):
        d = _transformer_engine(name, said, source)
    elif name.endswith("-mixed"):
        low = "float16" if name.startswith("16") else "bfloat16"
        d = Draft(SYSTEM, source, f"torch_autocast_{device}", f"{said}: MixedPrecision -> torch.autocast('{device}')")
        d.set("compute_dtype", low, said)
        if low == "float16":
            torch_amp.add_scaler(d, {}, prefix="MixedPrecision: GradScaler() ")
        else:
            d.set("loss_scale.mode", "none", f"{said}: MixedPrecision takes no scaler")
            d.set("loss_scale.skip_nonfinite", False, f"{said}: every step is taken")
        if kind == "fsdp":  # plugins/precision/fsdp.py FSDPPrecision.mixed_precision_config
            d.set("distributed.reduce_dtype", low, f"{said} with {at} FSDP: FSDPPrecision.mixed_precision_config: "
                  f"MixedPrecision(param_dtype=float32, reduce_dtype={low})")
        else:
            d.set("distributed.reduce_dtype", "float32", f"{said}: parameters (and gradients) stay float32")
        if fabric:  # the Trainer leaves autocast's outputs ("unchanged", the preset's)
            d.set("output_dtype", "float32", f"{said}: Fabric's MixedPrecision.convert_output casts to float32")
    else:
        low = "float16" if name.startswith("16") else "bfloat16"
        d = Draft(SYSTEM, source, "fp32", f"{said}: HalfPrecision converts the model to {low}")
        d.set("compute_dtype", low, said)
        d.set("param_dtype", low, f"{said}: module.to({low})")
        d.set("output_dtype", "float32" if fabric else low,
              f"{said}: Fabric's HalfPrecision.convert_output casts to float32" if fabric else
              f"{said}: the Trainer's HalfPrecision keeps outputs in {low}")
        d.set("ops.float32", [], f"{said}: no autocast, every op runs in {low}")
        d.set("master_weights.enabled", False, f"{said}: the optimizer steps the {low} parameters")
        d.set("distributed.reduce_dtype", low, f"{said}: gradients are {low}")
    d.ignored.extend(ignored)
    return d.build()


def _transformer_engine(name: str, said: str, source: str) -> Draft:
    low = "float16" if name.endswith("float16") else "bfloat16"
    d = Draft(SYSTEM, source, "torch_autocast_cuda",
              f"{said}: TransformerEnginePrecision's fallback torch.autocast('cuda', {low})")
    d.set("compute_dtype", low, f"{said}: fallback_compute_dtype = weights_dtype")
    d.set("param_dtype", low, f"{said}: convert_module: module.to({low})")
    d.set("master_weights.enabled", False, f"{said}: the optimizer steps the {low} parameters")
    d.set("output_dtype", "float32", f"{said}: convert_output casts to float32")
    d.set("loss_scale.mode", "none", f"{said}: TransformerEnginePrecision takes no scaler")
    d.set("loss_scale.skip_nonfinite", False, f"{said}: every step is taken")
    d.set("distributed.reduce_dtype", low, f"{said}: gradients are {low}")
    te = load("te_delayed").fp8
    d.set("fp8.enabled", True, f"{said}: te.fp8_autocast(enabled=True)")
    d.set("fp8.ops", ["linear"], f"{said}: _convert_layers replaces torch.nn.Linear with te.Linear")
    d.set("fp8.recipe", "delayed", f"{said}: recipe DelayedScaling()")
    d.set("fp8.amax_history", te.amax_history, "DelayedScaling() default (preset te_delayed)")
    d.set("fp8.forward_format", "e4m3", "DelayedScaling() default Format.HYBRID")
    d.set("fp8.gradient_format", "e5m2", "DelayedScaling() default Format.HYBRID")
    d.set("fp8.dims_multiple", 16, "_convert_layers skips Linear layers whose dims are not multiples of 8/16")
    return d


def _nemo(name: str, said: str, model: Mapping[str, Any], source: str, ignored: list[str],
          bert: bool = False) -> Imported:
    """NeMo's Megatron trainer (MegatronTrainerBuilder._plugins) for a 16/bf16 ``trainer.precision``;
    ``bert``: MegatronBertTrainerBuilder, whose _grad_scaler passes no hysteresis (NeMo GradScaler's 1)."""
    for key in ("fp32_residual_connection", "fp16_lm_cross_entropy", "fsdp"):
        if key in model and flag(source, f"model.{key}", model[key]):
            raise refuse(source, f"model.{key}", "True changes the dtype of tensors no canonical op names "
                         "(the residual stream, the LM-head loss, FSDP's flat parameters)",
                         "set it to False to import, or keep NeMo for this run")
    fp8 = "fp8" in model and flag(source, "model.fp8", model["fp8"])
    low = "float16" if name == "16-mixed" else "bfloat16"
    o2 = flag(source, "model.megatron_amp_O2", model.get("megatron_amp_O2", False))
    if o2:
        d = Draft(SYSTEM, source, "megatron_fp16", f"{said} + model.megatron_amp_O2: MegatronHalfPrecisionPlugin, "
                  f"Megatron half model (Megatron's fp32 softmax/norm lists)")
        d.set("compute_dtype", low, said)
        d.set("param_dtype", low, "model.megatron_amp_O2: the model is converted to half (Float16Module)")
        d.set("master_weights.enabled", True, "model.megatron_amp_O2: MainParamsOptimizerWrapper keeps fp32 "
                                              "main parameters")
        d.set("distributed.reduce_dtype", "float32" if low == "bfloat16" else "float16",
              "MegatronHalfPrecisionPlugin: 'BF16 uses FP32 grad accumulation'" if low == "bfloat16" else
              "MegatronHalfPrecisionPlugin: 'FP16 uses FP16 grad accumulation'")
    else:
        d = Draft(SYSTEM, source, "torch_autocast_cuda", f"{said}, model.megatron_amp_O2 False: "
                  f"PipelineMixedPrecisionPlugin -> torch.autocast")
        d.set("compute_dtype", low, said)
        d.set("distributed.reduce_dtype", "float32", f"{said}: parameters (and gradients) stay float32")
    if low == "float16":
        p = "model."
        init = number(source, f"{p}native_amp_init_scale", model.get("native_amp_init_scale", 2.0**32))
        interval = number(source, f"{p}native_amp_growth_interval", model.get("native_amp_growth_interval", 1000),
                          int, minimum=1)
        hyst = 1 if bert else number(source, f"{p}hysteresis", model.get("hysteresis", 2), int, minimum=1)
        def given(k: str) -> str:
            if bert and k == "hysteresis":
                return ("name megatron_bert: MegatronBertTrainerBuilder._grad_scaler passes no hysteresis "
                        "(GradScaler default 1)")
            return f"{p}{k}" if k in model else f"{p}{k} not given: NeMo default"

        d.set("loss_scale.mode", "dynamic", "NeMo GradScaler (fp16)")
        d.set("loss_scale.initial", init, given("native_amp_init_scale"))
        d.set("loss_scale.growth_factor", 2.0, "NeMo GradScaler: torch's growth_factor 2.0")
        d.set("loss_scale.backoff_factor", 0.5, "NeMo GradScaler: torch's backoff_factor 0.5")
        d.set("loss_scale.growth_interval", interval, given("native_amp_growth_interval"))
        d.set("loss_scale.growth_schedule", "interval", "NeMo GradScaler: torch._amp_update_scale_")
        d.set("loss_scale.hysteresis", hyst, given("hysteresis"))
        d.set("loss_scale.hysteresis_refill", ["finite"], "NeMo GradScaler.update: refilled on every finite step")
        d.set("loss_scale.min", 0.0, "NeMo GradScaler: no floor (torch's)")
        d.set("loss_scale.max", float("inf"), "NeMo GradScaler: no cap (torch's)")
        d.set("loss_scale.on_max", "keep", "torch._amp_update_scale_ keeps the scale when growth is not finite")
        d.set("loss_scale.growth_requires_finite", True, "torch._amp_update_scale_")
        d.set("loss_scale.at_min", "clamp", "NeMo GradScaler never raises")
        d.set("loss_scale.scale_dtype", "float32", "torch's scale is a float32 tensor")
        d.set("loss_scale.factor_arithmetic", "float64", "torch._amp_update_scale_ (as torch GradScaler)")
        d.set("loss_scale.skip_nonfinite", True, "NeMo GradScaler._maybe_opt_step skips the step")
    else:
        d.set("loss_scale.mode", "none", f"{said}: NeMo builds no scaler for bf16")
        d.set("loss_scale.skip_nonfinite", False, f"{said}: every step is taken")
    if fp8:
        _nemo_fp8(d, model, source)
    checked = [f"model.{k}={model[k]}" for k in ("fp32_residual_connection", "fp16_lm_cross_entropy", "fsdp", "fp8",
                                                  "megatron_amp_O2") if k in model and not model[k]]
    if checked:
        d.note(f"Read, changing nothing: {', '.join(checked)}")
    read = {"megatron_amp_O2", "fp32_residual_connection", "fp16_lm_cross_entropy", "fsdp", "fp8"}
    if low == "float16":
        read |= {"native_amp_init_scale", "native_amp_growth_interval"} | (set() if bert else {"hysteresis"})
    if fp8:
        read |= {k for k in NEMO_KEYS if k.startswith("fp8")}
    why = {"native_amp_init_scale": "fp16 only", "native_amp_growth_interval": "fp16 only",
           "hysteresis": "not read by MegatronBertTrainerBuilder" if bert else "fp16 only",
           "precision": "follows trainer.precision", "transformer_engine": "layer choice",
           "fsdp_grad_reduce_dtype": "fsdp is off"}
    for k in model:
        if k not in read:
            reason = why.get(k, "fp8 is off" if k.startswith("fp8") else "not a precision setting")
            ignored.append(f"model.{k} ({reason})")
    d.ignored.extend(ignored)
    return d.build()


def _nemo_fp8(d: Draft, model: Mapping[str, Any], source: str) -> None:
    """NeMo's fp8 keys (megatron_gpt_config.yaml: fp8_e4m3 / fp8_hybrid / fp8_margin / fp8_interval /
    fp8_amax_history_len / fp8_amax_compute_algo -> Transformer Engine's DelayedScaling)."""
    def get(k: str, default: Any) -> Any:
        return model.get(k, default)

    if number(source, "model.fp8_margin", get("fp8_margin", 0), int) != 0:
        raise refuse(source, "model.fp8_margin", "a scaling margin has no [fp8] key", "set it to 0 to import")
    if number(source, "model.fp8_interval", get("fp8_interval", 1), int) != 1:
        raise refuse(source, "model.fp8_interval", "an amax update interval has no [fp8] key", "set it to 1")
    if text(source, "model.fp8_amax_compute_algo", get("fp8_amax_compute_algo", "max")) != "max":
        raise refuse(source, "model.fp8_amax_compute_algo", "only 'max' over the history is held",
                     "set it to 'max'")
    e4m3 = flag(source, "model.fp8_e4m3", get("fp8_e4m3", False))
    hybrid = flag(source, "model.fp8_hybrid", get("fp8_hybrid", True))
    if e4m3 == hybrid:
        raise bad(source, "model.fp8_e4m3", "set exactly one of fp8_e4m3 and fp8_hybrid to True")
    d.set("fp8.enabled", True, "model.fp8")
    d.set("fp8.ops", ["linear"], "model.fp8: TE TransformerLayer linear layers")
    d.set("fp8.recipe", "delayed", "model.fp8: TE DelayedScaling")
    d.set("fp8.amax_history", number(source, "model.fp8_amax_history_len", get("fp8_amax_history_len", 1024),
                                     int, minimum=1), "model.fp8_amax_history_len")
    d.set("fp8.forward_format", "e4m3", "model.fp8_e4m3/fp8_hybrid")
    d.set("fp8.gradient_format", "e4m3" if e4m3 else "e5m2",
          "model.fp8_e4m3: Format.E4M3" if e4m3 else "model.fp8_hybrid: Format.HYBRID")


def _resolve(value: Any, root: Mapping[str, Any], source: str, where: str) -> Any:
    """An OmegaConf ``${a.b}`` interpolation resolved inside the same file, or a located error."""
    m = INTERPOLATION.match(value) if isinstance(value, str) else None
    if m is None:
        if isinstance(value, str) and "${" in value:
            raise bad(source, where, f"{short(value)} is an OmegaConf interpolation unimp cannot resolve; import "
                                     f"the resolved config (`python train.py --cfg job`)")
        return value
    node: Any = root
    for part in m.group(1).split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise bad(source, where, f"{short(value)} refers to a key this file does not hold; import the "
                                     f"resolved config (`python train.py --cfg job`)")
        node = node[part]
    return node


# NeMo 2 (nemo/lightning/pytorch/plugins/mixed_precision.py::MegatronMixedPrecision.__init__) -> the
# Megatron-core settings it configures, written as the Megatron arguments of the same name; its defaults
NEMO2_PLUGIN = "MegatronMixedPrecision"
NEMO2_ARGS: dict[str, tuple[str, Any]] = {"fp16_initial_loss_scale": ("--initial-loss-scale", 4294967296.0),
              "fp16_min_loss_scale": ("--min-loss-scale", 1.0), "fp16_loss_scale_window": ("--loss-scale-window", 1000),
              "fp16_hysteresis": ("--hysteresis", 2), "fp16_loss_scale": ("--loss-scale", None),
              "fp8": ("--fp8-format", None), "fp8_recipe": ("--fp8-recipe", "delayed"),
              "fp8_margin": ("--fp8-margin", 0), "fp8_amax_history_len": ("--fp8-amax-history-len", 1),
              "fp8_amax_compute_algo": ("--fp8-amax-compute-algo", "most_recent"),
              "first_last_layers_bf16": ("--first-last-layers-bf16", False),
              "num_layers_at_start_in_bf16": ("--num-layers-at-start-in-bf16", 0),
              "num_layers_at_end_in_bf16": ("--num-layers-at-end-in-bf16", 0)}
NEMO2_SAME = {"autocast_enabled": False, "autocast_dtype": None, "params_dtype": None, "pipeline_dtype": None,
              "fp8_wgrad": True, "fp8_dot_product_attention": False, "fp8_multi_head_attention": False,
              "fp4": None, "reuse_grad_buf_for_mxfp8_param_ag": False}
NEMO2_NOTED = ("fp8_params", "fp8_param_gather")
DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "half": "float16", "fp16": "float16",
               "float32": "float32", "float": "float32", "fp32": "float32"}


def _nemo2(plugin: Mapping[str, Any], raw: Mapping[str, Any], at: str, source: str, ignored: list[str]) -> Imported:
    """NeMo 2's ``MegatronMixedPrecision`` plugin: ``convert_module`` wraps the model in Megatron's
    ``Float16Module`` (fp16 / bf16 model, fp32 outputs) with Megatron-core's float32 main params, its
    ``DynamicGradScaler`` settings (``fp16_*``), ``grad_reduce_in_fp32`` (default true) and FP8
    settings: imported as the Megatron run with the same settings."""
    from unimp.migrate import megatron
    from unimp.migrate.draft import relabel

    kw = {k: _resolve(v, raw, source, f"{at}.{k}") for k, v in plugin.items() if k != "_target_"}
    known = ("precision", "grad_reduce_in_fp32", *NEMO2_ARGS, *NEMO2_SAME, *NEMO2_NOTED)
    for key in kw:
        if key not in known:
            raise bad(source, f"{at}.{key}", f"not an argument of {NEMO2_PLUGIN} (known: {', '.join(known)})")
    low_name = {"bf16": "bfloat16", "bf16-mixed": "bfloat16", "16": "float16", "16-mixed": "float16",
                "fp16": "float16", "fp16-mixed": "float16"}.get(str(kw.get("precision")), "float32")
    dtype_notes = []
    for key in ("params_dtype", "pipeline_dtype", "autocast_dtype"):  # nemo/collections/llm/recipes/precision
        value = kw.get(key)  # bf16_mixed(): params_dtype = pipeline_dtype = torch.bfloat16, as Float16Module runs
        if isinstance(value, str) and DTYPE_NAMES.get(value.removeprefix("torch.")) in (low_name, "float32"):
            kw.pop(key)  # float32 is MegatronMixedPrecision's own params_dtype default; the model is still converted
            dtype_notes.append(f"{at}.{key} = {value}: Float16Module converts the model to the precision's dtype "
                               f"either way (mixed_precision.py convert_module)")
    for key, default in NEMO2_SAME.items():
        if kw.get(key) not in (default, None) and not (default is False and kw.get(key) is False):
            raise refuse(source, f"{at}.{key}", f"{short(kw[key])}: unimp imports {NEMO2_PLUGIN} with its default "
                         f"({default}) only", f"remove {key}")
    if "precision" not in kw:
        raise bad(source, f"{at}.precision", f"not given: {NEMO2_PLUGIN} requires it ('16-mixed', 'bf16-mixed', '32')")
    precision = str(kw["precision"])
    low = {"bf16": "--bf16", "bf16-mixed": "--bf16", "16": "--fp16", "16-mixed": "--fp16", "fp16": "--fp16",
           "fp16-mixed": "--fp16", "32": "", "fp32": "", "32-true": ""}.get(precision)
    if low is None:
        raise bad(source, f"{at}.precision", f"{short(kw['precision'])} is not one of '16-mixed', 'bf16-mixed', '32' "
                                             f"(mixed_precision.py: anything else runs float32)")
    why = f"{at}: NeMo 2 {NEMO2_PLUGIN}(precision={precision!r}): Megatron-core's Float16Module and optimizer"
    if not low:
        if kw.get("fp8") is not None:
            raise refuse(source, f"{at}.fp8", "FP8 over a float32 model is not imported", "use precision bf16-mixed")
        d = Draft(SYSTEM, source, "fp32", f"{at}.precision={precision!r}: MegatronMixedPrecision keeps float32")
        d.ignored.extend([*ignored, *(f"{at}.{k}" for k in kw if k != "precision")])
        return d.build()
    reduce32 = flag(source, f"{at}.grad_reduce_in_fp32", kw.get("grad_reduce_in_fp32", True))
    args = [low]
    if reduce32 and low == "--fp16":
        args.append("--accumulate-allreduce-grads-in-fp32")
    if not reduce32 and low == "--bf16":
        args.append("--grad-reduce-in-bf16")
    for key, (arg, default) in NEMO2_ARGS.items():
        value = kw.get(key, default)
        if key.startswith("fp16_") and key not in kw and kw.get("fp16_loss_scale") is not None:
            continue  # a static scale: the DynamicGradScaler defaults are not read (ConstantGradScaler)
        if value is None or (value == default and not key.startswith("fp16_")) or (
                key.startswith("fp16_") and low == "--bf16") or (key.startswith("fp8_") and kw.get("fp8") is None):
            continue
        args += [arg] if value is True else [arg, str(value)]
    imp = megatron.import_policy(args, source=f"{source}: {at}")
    notes = [f"{at} read as the Megatron arguments {' '.join(args)} (NeMo 2 sets the same Megatron-core config "
             f"fields: DtypeConfig in mixed_precision.py; grad_reduce_in_fp32 "
             f"{'true (default)' if 'grad_reduce_in_fp32' not in kw else str(reduce32).lower()})"]
    notes += [f"{at}.{k}: where the FP8 weights are cast, not a dtype (ignored)" for k in NEMO2_NOTED if kw.get(k)]
    notes += dtype_notes
    if low == "--bf16":
        notes += [f"{at}.{k}: read for 16-mixed only (ignored)" for k in kw if k.startswith("fp16_")]
    return relabel(imp, SYSTEM, source, why, tuple(ignored), tuple(notes))


def _from_mapping(raw: Mapping[str, Any], source: str) -> Imported:
    trainer: Mapping[str, Any] = raw
    prefix = ""
    ignored: list[str] = []
    if "trainer" in raw and isinstance(raw["trainer"], Mapping):
        trainer, prefix = raw["trainer"], "trainer."
        ignored += [f"{k} (not the trainer)" for k in raw if k not in ("trainer", "model")]
    elif "precision" not in raw and "fabric" in raw and isinstance(raw["fabric"], Mapping):
        trainer, prefix = raw["fabric"], "fabric."
    for where, node in (("plugins", raw.get("plugins")), (f"{prefix}plugins", trainer.get("plugins"))):
        for i, plugin in enumerate(node if isinstance(node, list) else [node]):
            if isinstance(plugin, Mapping) and str(plugin.get("_target_", "")).endswith(NEMO2_PLUGIN):
                at = f"{where}[{i}]" if isinstance(node, list) else where
                if "precision" in trainer:
                    raise bad(source, f"{prefix}precision", f"given together with {at} ({NEMO2_PLUGIN}): Lightning "
                              "refuses a precision and a precision plugin (accelerator_connector.py); keep one")
                rest = [i for i in ignored if not i.startswith("plugins ")] + (["model (not the trainer)"] if
                                                                               "model" in raw and prefix else [])
                return _nemo2(plugin, raw, at, source, rest + [f"{prefix}{k}" for k in trainer if k != "plugins"]
                              if prefix else [k for k in raw if k != "plugins"])
    if isinstance(trainer.get("plugins"), list | Mapping | str) and trainer.get("plugins"):
        raise refuse(source, f"{prefix}plugins", "a plugin object may set its own precision (MixedPrecision with "
                     "a scaler, a custom plugin), which a config file cannot show", "remove it to import the "
                     "precision string, or import the plugin's GradScaler(...) with --from torch")
    if "precision" not in trainer:
        target = str(trainer.get("_target_", ""))
        if "defaults" in trainer:
            raise bad(source, f"{prefix}precision", "not in this file; hydra takes it from the files in its "
                      "`defaults` list: import the composed config (`python train.py --cfg job > cfg.yaml`)")
        if target.rpartition(".")[2] in TRAINERS:  # a Trainer config without precision: say what Lightning runs
            raise bad(source, f"{prefix}precision", f"nothing read: not in this file; {short(target)} then runs "
                      f"its default '32-true' (accelerator_connector.py: precision None -> '32-true'): add "
                      f"`precision: 32-true` to import that, or import the config that sets it")
        raise bad(source, "precision", "nothing read: no `precision` key at the top, under `trainer:` or in a "
                  "Trainer(...) call, so this is not a Lightning precision setting; pass the Trainer config "
                  "(or --from the system this file belongs to)")
    where = f"{prefix}precision"
    precision = _resolve(trainer["precision"], raw, source, where)
    fabric = prefix == "fabric."
    litgpt = not prefix and any(k in raw for k in LITGPT_KEYS)
    if litgpt:  # litgpt's CLI configs: L.Fabric(precision=...)
        fabric = True
        quantize = raw.get("quantize")
        if quantize is not None:
            raise refuse(source, "quantize", f"{short(quantize)}: litgpt runs BitsandbytesPrecision, weights held "
                         f"in {short(str(quantize)[4:])} (quantized), which a unimp policy does not hold",
                         "import a config without `quantize` (full or LoRA finetuning)")
        if precision is None:
            raise bad(source, "precision", "null: litgpt picks get_default_supported_precision(training=True) on "
                                           "the machine it runs on (bf16 or 16); write the precision to import it")
    model = raw.get("model") if prefix == "trainer." else None
    nemo = model if isinstance(model, Mapping) and any(k in model for k in NEMO_KEYS if k != "precision") else None
    if isinstance(model, Mapping) and nemo is None:
        ignored.append("model (no NeMo precision key)")
    accelerator = trainer.get("accelerator")
    ignored += [f"{prefix}{k}" for k in trainer if k not in ("precision", "accelerator", "_target_", "strategy")]
    strategy = _resolve(trainer.get("strategy"), raw, source, f"{prefix}strategy")
    if "strategy" in trainer and (nemo is not None or not _strategy(strategy, source, f"{prefix}strategy")[0]):
        ignored.append(f"{prefix}strategy")
    if "_target_" in trainer:
        ignored.append(f"{prefix}_target_ (the Trainer class)")
    if litgpt and strategy is None and "lora_r" not in raw and (raw.get("devices", "auto"), raw.get("num_nodes", 1)) \
            != (1, 1):  # litgpt pretrain.py, finetune/full.py, adapter*.py: FSDPStrategy when devices * num_nodes > 1
        strategy = "fsdp"
        ignored = [i if i != "devices" else "devices (more than one: litgpt runs Fabric's FSDPStrategy, pretrain.py "
                   "/ finetune full.py setup)" for i in ignored]
    bert = str(raw.get("name", "")).startswith("megatron_bert")
    return _read(precision, source, fabric, accelerator, nemo, ignored, where, bert, strategy)


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, Mapping):
        return _from_mapping(raw, source)
    value = raw.strip()
    if "(" not in value and "=" not in value and ":" not in value:
        return import_policy(value.strip("'\""), source=source)
    if "(" not in value and ":" in value:  # `precision: 16` pasted from a YAML file
        from unimp.migrate.parsing import pasted_yaml

        return _from_mapping(pasted_yaml(value, source, "a precision, Trainer(precision=...) or a YAML `precision:` "
                                                        "key"), source)
    found: list[tuple[str, dict[str, Any]]] = []
    for c in calls(value, source, TRAINERS):
        if c.name is not None and c.last not in TRAINERS:
            raise bad(source, c.name, f"unknown call {short(c.name)}; expected Trainer(...) or Fabric(...)")
        if c.args:
            raise bad(source, c.name or "", "positional arguments cannot be read; write precision=...")
        found.append((c.last or "", c.kwargs))
    kwargs: dict[str, Any] = {}
    fabric = False
    for call, kw in found:
        fabric = fabric or call == "Fabric"
        kwargs.update(kw)
    if "precision" not in kwargs:
        raise bad(source, "precision", "nothing read: no precision=... in what was given; Lightning's default is "
                                       "'32-true': pass precision='32-true' to import that")
    if kwargs.get("plugins"):
        raise refuse(source, "plugins", "a plugin object may set its own precision", "remove it to import")
    strategy = kwargs.get("strategy")
    ignored = [k for k in kwargs if k not in ("precision", "accelerator") and (k != "strategy" or not _strategy(
        strategy, source, "strategy")[0])]
    return _read(kwargs["precision"], source, fabric, kwargs.get("accelerator"), None, ignored, strategy=strategy)


def export_policy(policy: Policy) -> Exported:
    """The ``precision`` string closest to the policy."""
    c, p = policy.compute_dtype, policy.param_dtype
    if policy.fp8.enabled and c != "float32":
        name = "transformer-engine" if c == "bfloat16" else "transformer-engine-float16"
    elif c == "float32":
        name = "32-true"
    elif p == "float32":
        name = "16-mixed" if c == "float16" else "bf16-mixed"
    else:
        name = "16-true" if p == "float16" else "bf16-true"
    cpu = policy.ops.category("softmax") != "float32" and name.endswith("-mixed") and c == "bfloat16"
    # Fabric's Half/MixedPrecision cast outputs back to float32, the Trainer's do not
    fabric = c != "float32" and policy.output_dtype == "float32" and (name.endswith("-true") or not cpu)
    if fabric:
        text_ = f"fabric = Fabric(precision={name!r})\n"
        config: Any = {"fabric": {"precision": name}}
    else:
        text_ = f"trainer = Trainer(precision={name!r}" + (", accelerator='cpu'" if cpu else "") + ")\n"
        config = {"precision": name, "accelerator": "cpu"} if cpu else name
    return finish(SYSTEM, policy, config, text_, lambda c: from_cli(c, "lightning"))
