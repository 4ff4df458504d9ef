"""Accelerate: ``Accelerator(mixed_precision="no"|"fp16"|"bf16"|"fp8", kwargs_handlers=[GradScalerKwargs(...)])``,
both directions (a ``mixed_precision:`` line of an ``accelerate config`` YAML file works too).

Defaults read from accelerate/utils/dataclasses.py (GradScalerKwargs): init_scale 65536.0,
growth_factor 2.0, backoff_factor 0.5, growth_interval 2000, enabled True; fp16 and bf16 run
``torch.autocast`` on the accelerator (CUDA lists), fp16 with ``torch.amp.GradScaler``.

An ``accelerate config`` YAML file (huggingface/accelerate 16cb6eb80dd9aa8b4df1a63ef57863e455d53b83)
is read as ``accelerate launch`` reads it: ``distributed_type: FSDP`` adds FSDP's MixedPrecision
(utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision: param_dtype = reduce_dtype =
the mixed-precision dtype, fp32 sharded params kept) under the same autocast (accelerator.py:
native_amp for every distributed type but DeepSpeed / Megatron-LM); ``distributed_type: DEEPSPEED``
hands precision to DeepSpeed (state.py: mixed_precision "no" for Accelerate itself;
DeepSpeedPlugin.set_mixed_precision writes ``fp16: {enabled, auto_cast}`` / ``bf16: {enabled}``,
zero_stage default 2) and is imported by :mod:`unimp.migrate.deepspeed`; ``mixed_precision: fp8``
with ``fp8_config`` (TERecipeKwargs / AORecipeKwargs) imports to the ``[fp8]`` table over bf16
autocast ("When training in fp8, we still rely on bf16 autocast"). A file without
``mixed_precision`` is an error (it holds no precision setting).

>>> import_policy("bf16").policy.compute_dtype
'bfloat16'
>>> export_policy(import_policy("fp16").policy).config["GradScalerKwargs"]["growth_interval"]
2000
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unimp.migrate import torch as torch_amp
from unimp.migrate.draft import Draft, Exported, Imported, relabel
from unimp.migrate.export_check import finish
from unimp.migrate.parsing import kwargs_of, leading_name, pasted_json, plain
from unimp.migrate.values import bad, check_keys, refuse
from unimp.policy import Policy
from unimp.policy.spec import short, show

SYSTEM = "accelerate"
PRECISIONS = ("no", "fp16", "bf16", "fp8")
SCALER_KEYS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def _val(v: Any) -> str:
    """A source value for a note: numbers and booleans as written, anything else quoted and bounded."""
    return repr(v) if isinstance(v, bool | int | float) else short(v)


def import_policy(mixed_precision: str = "no", grad_scaler_kwargs: Mapping[str, Any] | None = None, *,
                  source: str = "accelerate", ignored: tuple[str, ...] = (), device: str = "cuda") -> Imported:
    """The policy of ``Accelerator(mixed_precision=..., kwargs_handlers=[GradScalerKwargs(**grad_scaler_kwargs)])``."""
    if mixed_precision not in PRECISIONS:
        raise bad(source, "mixed_precision", f"{short(mixed_precision)} is not one of {', '.join(PRECISIONS)}")
    if mixed_precision == "fp8":
        return _fp8({"fp8_config": {"backend": "TE"}}, source, ignored)
    if grad_scaler_kwargs is not None and not isinstance(grad_scaler_kwargs, Mapping):
        raise bad(source, "GradScalerKwargs", f"expected a table of GradScaler arguments (e.g. init_scale: 1024), "
                                              f"got {show(grad_scaler_kwargs)}")
    kw = dict(grad_scaler_kwargs or {})
    check_keys(kw, SCALER_KEYS, source, "GradScalerKwargs.")
    if kw and mixed_precision != "fp16":
        raise refuse(source, "GradScalerKwargs", f"Accelerate uses a GradScaler only with fp16, not "
                     f"{short(mixed_precision)}", "remove GradScalerKwargs or use mixed_precision='fp16'")
    if mixed_precision == "no":
        d = Draft(SYSTEM, source, "fp32", "mixed_precision='no': full precision")
    elif device == "cpu":
        if mixed_precision == "fp16":
            raise refuse(source, "mixed_precision", "'fp16' on CPU: accelerator.py Accelerator.__init__ sets "
                         "native_amp for fp16 only when device.type != 'cpu' (the run is full precision) until "
                         "huggingface/accelerate PR #3373, later versions autocast fp16 on CPU: which one runs "
                         "depends on the installed Accelerate",
                         "import mixed_precision 'bf16' (CPU autocast) or 'no'")
        d = Draft(SYSTEM, source, "torch_autocast_cpu", "mixed_precision='bf16' on CPU: accelerator.py native_amp for "
                  "device 'cpu', torch.autocast(device_type='cpu') (CPU op lists)")
        d.set("compute_dtype", "bfloat16", "mixed_precision='bf16'")
        d.set("loss_scale.mode", "none", "mixed_precision='bf16': no GradScaler")
        d.set("loss_scale.skip_nonfinite", False, "mixed_precision='bf16': every step is taken")
    else:
        d = Draft(SYSTEM, source, "torch_autocast_cuda", f"mixed_precision={short(mixed_precision)}: torch.autocast "
                  f"on the accelerator (CUDA op lists)")
        d.set("output_dtype", "float32", "prepare_model: forward wrapped in autocast then convert_outputs_to_fp32")
        if mixed_precision == "bf16":
            d.set("compute_dtype", "bfloat16", "mixed_precision='bf16'")
            d.set("loss_scale.mode", "none", "mixed_precision='bf16': no GradScaler")
            d.set("loss_scale.skip_nonfinite", False, "mixed_precision='bf16': every step is taken")
        else:
            d.set("compute_dtype", "float16", "mixed_precision='fp16'")
            torch_amp.add_scaler(d, kw, prefix="GradScalerKwargs.")
    d.ignored.extend(ignored)
    return d.build()


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, str) and raw.lstrip().startswith("{"):  # a JSON table pasted as a string
        raw = plain(pasted_json(raw, source, "", "not a JSON table"), source)
    if isinstance(raw, str) and ":" in raw and "(" not in raw and "=" not in raw:  # lines pasted from the YAML file
        from unimp.migrate.parsing import pasted_yaml

        return import_config(pasted_yaml(raw, source, "a precision, Accelerator(mixed_precision=...) or lines of an "
                                                      "accelerate config YAML file"), source=source)
    name, raw = leading_name(raw)
    if name is not None:
        scaler = kwargs_of(raw, source, {"GradScalerKwargs": "scaler"}).get("scaler") if raw.strip() else None
        return import_policy(name, scaler, source=source)
    if isinstance(raw, Mapping) and (CONFIG_KEYS & set(raw) or "mixed_precision" in raw):  # an `accelerate config` file
        return import_config(raw, source=source)
    kw = kwargs_of(raw, source, {"Accelerator": "accelerator", "GradScalerKwargs": "scaler"})
    acc = kw.get("accelerator", {})
    check_keys(acc, ("mixed_precision",), source, "Accelerator.")
    if "mixed_precision" not in acc:
        raise bad(source, "mixed_precision", "not given: Accelerator() then takes it from ACCELERATE_MIXED_PRECISION "
                                             "or the accelerate config file, which this input does not hold; pass "
                                             "mixed_precision ('no', 'fp16', 'bf16' or 'fp8')")
    return import_policy(acc["mixed_precision"], kw.get("scaler"), source=source)


CONFIG_KEYS = {"distributed_type", "compute_environment", "num_processes", "fsdp_config", "deepspeed_config",
               "downcast_bf16", "fp8_config", "megatron_lm_config", "use_cpu"}
FSDP_PRECISION = ("fsdp_mixed_precision_policy", "mixed_precision_policy")


def import_config(cfg: Mapping[str, Any], *, source: str = "accelerate config") -> Imported:
    """The policy ``accelerate launch --config_file`` runs with this YAML file (parsed)."""
    if "mixed_precision" not in cfg and not _ds_file(cfg):
        raise bad(source, "mixed_precision", "not given: the file holds no precision setting (Accelerate then runs "
                                             "'no', full precision, unless --mixed_precision is passed at launch); "
                                             "add `mixed_precision: 'no'` (or fp16 / bf16 / fp8)")
    mp = cfg.get("mixed_precision")
    mp = "no" if mp is None and _ds_file(cfg) else mp
    if mp not in PRECISIONS:
        raise bad(source, "mixed_precision", f"{short(mp)} is not one of {', '.join(PRECISIONS)}")
    dist = str(cfg.get("distributed_type", "NO"))
    handled = {"mixed_precision", "GradScalerKwargs", "distributed_type", "fsdp_config", "deepspeed_config",
               "downcast_bf16", "fp8_config"}
    rest = tuple(k for k in cfg if k not in handled)
    down = cfg.get("downcast_bf16", "no")
    if down not in ("no", False, None) and dist not in ("XLA", "TPU"):
        raise bad(source, "downcast_bf16", f"{short(down)} off TPU: accelerator.py raises 'Can only use "
                                           "`downcast_bf16` when using mixed_precision='bf16' and on a TPU'; remove it")
    if dist in ("XLA", "TPU") and mp == "bf16":
        raise refuse(source, "distributed_type", "bf16 on TPU sets XLA_USE_BF16 / XLA_DOWNCAST_BF16 (state.py): XLA "
                     "stores every float32 tensor, optimizer state included, as bf16; unimp keeps float32 masters",
                     "import mixed_precision: 'bf16' for a GPU run, or keep this run in Accelerate")
    notes = [f"distributed_type = {short(dist)}: " + {"FSDP": "FSDP MixedPrecision under autocast (below)", "DEEPSPEED":
                                                   "DeepSpeed runs the precision (state.py)", "MEGATRON_LM":
                                                   "Megatron-LM runs the precision (no Accelerate autocast)"}.get(
        dist, "plain data parallel: the mixed_precision autocast (below)")]
    if "downcast_bf16" in cfg:
        notes.append(f"downcast_bf16 = {_val(down)}: applies on TPU only (state.py XLA_DOWNCAST_BF16)")
    for key in ("fsdp_config", "deepspeed_config"):
        if key in cfg and not cfg[key]:
            notes.append(f"{key}: empty")
    if dist == "DEEPSPEED":
        return _with_notes(_deepspeed(cfg, mp, source, rest), notes)
    if dist == "MEGATRON_LM":
        return _with_notes(_megatron(mp, source, rest), notes)
    if mp == "fp8":
        return _with_notes(_fp8(cfg, source, rest), notes)
    fsdp = cfg.get("fsdp_config") or {}
    if dist == "FSDP" and not isinstance(fsdp, Mapping):
        raise bad(source, "fsdp_config", "expected a table")
    cpu = dist == "MULTI_CPU" or cfg.get("use_cpu") is True
    if cpu and dist == "FSDP":
        raise refuse(source, "use_cpu", "FSDP on CPU is not imported", "import a GPU config")
    if dist != "FSDP" or mp == "no":
        imp = import_policy(mp, cfg.get("GradScalerKwargs"), source=source, device="cpu" if cpu else "cuda",
                            ignored=tuple(k for k in rest if not (cpu and k == "use_cpu")) + tuple(
                                k for k in ("fsdp_config", "deepspeed_config") if cfg.get(k)))
        if cpu and "use_cpu" in cfg:
            notes.append("use_cpu = true: the run is on the CPU (state.py device 'cpu')")
        return _with_notes(imp, notes)
    for key in FSDP_PRECISION:
        if key in fsdp:
            raise refuse(source, f"fsdp_config.{key}", "a custom FSDP MixedPrecision is not read",
                         "remove it: Accelerate then sets param_dtype = reduce_dtype = the mixed_precision dtype")
    imp = import_policy(mp, cfg.get("GradScalerKwargs"), source=source, ignored=rest)
    d = _redraft(imp, source, f"distributed_type FSDP, mixed_precision {short(mp)}")
    low = "bfloat16" if mp == "bf16" else "float16"
    why = ("fsdp_config: utils/dataclasses.py FullyShardedDataParallelPlugin.set_mixed_precision: "
           f"MixedPrecision(param_dtype={low}, reduce_dtype={low})")
    d.set("param_dtype", low, why)
    d.set("master_weights.enabled", True, "FSDP keeps the sharded float32 params the optimizer steps")
    d.set("distributed.reduce_dtype", low, why)
    d.ignored.extend(f"fsdp_config.{k}" for k in fsdp)
    d.notes += notes
    return d.build()


def _with_notes(imp: Imported, notes: list[str]) -> Imported:
    """``imp`` with ``notes`` added to its file's header (where each handled source key went)."""
    head = "".join(f"# {n}\n" for n in notes)
    first, _, rest = imp.text.partition("\n")
    return Imported(imp.system, imp.policy, f"{first}\n{head}{rest}", imp.ignored)


def _redraft(imp: Imported, source: str, why: str) -> Draft:
    """A Draft continuing ``imp`` (its keys and comments), to add more keys to."""
    import tomllib

    data = tomllib.loads(imp.text)
    d = Draft(SYSTEM, source, data["extends"], why)
    for line in imp.text.splitlines():
        if line.startswith("# ") and not line.startswith(("# Imported", "# Not precision")):
            d.notes.append(line[2:])
    table = ""
    for line in imp.text.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        elif " = " in line and not line.startswith(("#", "name", "extends")):
            key, _, rest = line.partition(" = ")
            value, _, origin = rest.partition("  # ")
            d.set(f"{table}.{key}" if table else key, tomllib.loads(f"v = {value}")["v"], origin)
    d.ignored.extend(imp.ignored)
    return d


def _ds_file(cfg: Mapping[str, Any]) -> Any:
    ds = cfg.get("deepspeed_config")
    return ds.get("deepspeed_config_file") if isinstance(ds, Mapping) else None


def _deepspeed(cfg: Mapping[str, Any], mp: str, source: str, rest: tuple[str, ...]) -> Imported:
    """distributed_type DEEPSPEED: the DeepSpeed config DeepSpeedPlugin builds, imported as DeepSpeed."""
    from unimp.migrate import deepspeed

    ds = cfg.get("deepspeed_config") or {}
    if not isinstance(ds, Mapping):
        raise bad(source, "deepspeed_config", "expected a table")
    path = ds.get("deepspeed_config_file")
    if path:
        raise refuse(source, "deepspeed_config.deepspeed_config_file", f"the precision is in that DeepSpeed JSON "
                     f"({short(path)}); its fp16/bf16 \"auto\" values are filled from mixed_precision "
                     f"({short(mp)}, DeepSpeedPlugin.set_mixed_precision)",
                     f"import it: `unimp import {path} --from deepspeed --assume "
                     f"{'fp16=true' if mp == 'fp16' else 'bf16=true' if mp in ('bf16', 'fp8') else 'fp16=false'}`")
    if mp == "fp8":
        raise refuse(source, "mixed_precision", "fp8 under DeepSpeed (MS-AMP) is not imported",
                     "keep this run in Accelerate, or import mixed_precision: 'bf16'")
    stage = ds.get("zero_stage", 2)  # DeepSpeedPlugin.zero_stage default 2
    config: dict[str, Any] = {"zero_optimization": {"stage": stage}}
    if mp == "fp16":
        config["fp16"] = {"enabled": True, "auto_cast": True}
    elif mp == "bf16":
        config["bf16"] = {"enabled": True}
    else:
        config["fp16"] = {"enabled": False}
    imp = deepspeed.import_policy(config, source=f"{source}: deepspeed_config (as DeepSpeedPlugin builds it)")
    ignored = rest + tuple(f"deepspeed_config.{k}" for k in ds if k != "zero_stage")
    where = "deepspeed_config.zero_stage" if "zero_stage" in ds else "deepspeed_config.zero_stage not given"
    return relabel(imp, SYSTEM, source, "distributed_type DEEPSPEED", ignored,
                   (f"{where} = {_val(stage)}: DeepSpeedPlugin writes it as zero_optimization.stage; mixed_precision "
                    f"{_val(mp)}: DeepSpeedPlugin.set_mixed_precision writes the fp16/bf16 section",))


def _megatron(mp: str, source: str, rest: tuple[str, ...]) -> Imported:
    """distributed_type MEGATRON_LM: accelerator.py builds no autocast (native_amp is off for Megatron-LM);
    utils/dataclasses.py MegatronLMPlugin.set_mixed_precision sets Megatron's fp16 / bf16 argument."""
    from unimp.migrate import megatron

    if mp == "fp8":
        raise refuse(source, "mixed_precision", "fp8 through the Megatron-LM plugin is not imported",
                     "import the Megatron-LM arguments with --from megatron")
    if mp == "no":
        return import_policy("no", source=source, ignored=rest)
    arg = "--fp16" if mp == "fp16" else "--bf16"
    imp = megatron.import_policy([arg], source=f"{source}: megatron_lm_config")
    return relabel(imp, SYSTEM, source, f"distributed_type MEGATRON_LM: MegatronLMPlugin.set_mixed_precision -> {arg}",
                   rest, (f"mixed_precision {_val(mp)}: MegatronLMPlugin.set_mixed_precision sets Megatron's "
                          f"{arg[2:]} argument, read as `{arg}` (Megatron's defaults for the rest)",))


def _fp8(cfg: Mapping[str, Any], source: str, rest: tuple[str, ...]) -> Imported:
    """mixed_precision fp8: the fp8_config recipe over bf16 autocast."""
    fp8 = cfg.get("fp8_config") or {}
    if not isinstance(fp8, Mapping):
        raise bad(source, "fp8_config", "expected a table")
    backend = str(fp8.get("backend", "TE")).upper()
    p = "fp8_config."
    if backend in ("MSAMP", "MS-AMP"):
        raise refuse(source, f"{p}backend", "MS-AMP keeps weights and optimizer states in FP8/FP16 (opt_level "
                     f"{short(fp8.get('opt_level', 'O2'))}); unimp keeps float32 masters", "use backend TE or AO")
    if backend == "AO":
        d = Draft(SYSTEM, source, "torchao_float8", "fp8_config.backend AO: torchao Float8Linear (tensorwise) "
                  "over bf16 autocast")
        d.note("fp8_config.backend AO: accelerate/utils/ao.py convert_model_to_fp8_ao keeps the first and last "
               "nn.Linear out of FP8 (filter_first_and_last_linear_layers) and layers whose dims are not multiples of "
               "16 (unimp: dims_multiple = 16, the same); the first/last layers are not named here: add "
               "[[overrides]] with their module paths and fp8 = false to match", warn=True)
        d.ignored.extend(rest + tuple(f"{p}{k}" for k in fp8 if k != "backend"))
        return d.build()
    if backend != "TE":
        raise bad(source, f"{p}backend", f"{short(backend)} is not one of TE, MSAMP, AO")
    d = Draft(SYSTEM, source, "te_delayed", "fp8_config.backend TE: Transformer Engine DelayedScaling over bf16 "
              "autocast (TERecipeKwargs)")
    algo = str(fp8.get("amax_compute_algo", "most_recent")).lower()
    if algo not in ("max", "most_recent"):
        raise bad(source, f"{p}amax_compute_algo", f"{short(algo)} is not max or most_recent")
    for key, want in (("margin", 0), ("interval", 1)):
        if fp8.get(key, want) != want:
            raise refuse(source, f"{p}{key}", f"{short(fp8[key])}: unimp's delayed recipe has {key} {want}",
                         f"set {key}: {want}")
    over = fp8.get("override_linear_precision", (False, False, False))
    if over not in ((False, False, False), [False, False, False], "(false, false, false)", "[false, false, false]"):
        raise refuse(source, f"{p}override_linear_precision", f"{short(over)}: GEMMs kept in high precision "
                     "have no key",
                     "set [false, false, false]")
    d.note(f"{p}backend TE, amax_compute_algo {algo}, amax_history_len {fp8.get('amax_history_len', 1024)}, "
           f"margin {fp8.get('margin', 0)}, interval "
           f"{fp8.get('interval', 1)}, override_linear_precision {over}: unimp's delayed recipe (the max of the amax "
           f"history, no margin, scales updated every step, every GEMM of the FP8 layers in FP8)")
    fmt = str(fp8.get("fp8_format", "HYBRID")).upper()
    if fmt not in ("HYBRID", "E4M3"):
        raise bad(source, f"{p}fp8_format", f"{short(fmt)} is not HYBRID or E4M3")
    given = "" if "amax_compute_algo" in fp8 else " (TERecipeKwargs default)"
    # Transformer Engine (transformer_engine/pytorch/fp8.py _default_get_amax_and_update_history): "max" takes
    # torch.max(amax_history), "most_recent" amax_history[0] alone: the max over a history of 1
    if algo == "most_recent":
        d.set("fp8.amax_history", 1, f"{p}amax_compute_algo most_recent{given}: the scale follows the latest amax "
              f"only (the history length is then unused): unimp's max over a history of 1")
    else:
        d.set("fp8.amax_history", int(fp8.get("amax_history_len", 1024)), f"{p}amax_history_len" if
              "amax_history_len" in fp8 else f"{p}amax_history_len not given: TERecipeKwargs default 1024")
    d.set("fp8.forward_format", "e4m3", f"{p}fp8_format {fmt}")
    d.set("fp8.gradient_format", "e5m2" if fmt == "HYBRID" else "e4m3", f"{p}fp8_format {fmt}" if "fp8_format" in fp8
          else f"{p}fp8_format not given: TERecipeKwargs default HYBRID")
    if "use_autocast_during_eval" in fp8:
        d.note(f"{p}use_autocast_during_eval: evaluation only, not training numerics (ignored)")
    d.ignored.extend(rest + (("fp8_config.use_autocast_during_eval",) if "use_autocast_during_eval" in fp8 else ()))
    return d.build()


def export_policy(policy: Policy) -> Exported:
    """``{"mixed_precision": ..., "GradScalerKwargs": {...}}`` for the policy, or an ``accelerate config``
    file's keys (``distributed_type: FSDP`` for low-precision params and reduce, ``fp8_config`` for FP8)."""
    mp = {"float16": "fp16", "bfloat16": "bf16"}.get(policy.compute_dtype, "no")
    cfg: dict[str, Any] = {"mixed_precision": mp}
    low = policy.compute_dtype if mp != "no" else None
    notes: list[str] = []
    ls = policy.loss_scale
    if low and policy.param_dtype == low and policy.output_dtype == low and not policy.ops.float32:
        # the whole model in the low dtype: DeepSpeed's engine (module.half() / module.bfloat16())
        zero = ls.mode == "dynamic" and (ls.hysteresis > 1 or ls.at_min == "error")
        cfg = {"distributed_type": "DEEPSPEED", "mixed_precision": mp, "deepspeed_config": {"zero_stage": int(zero)}}
        if zero:
            notes.append("deepspeed_config.zero_stage = 1: the policy holds no ZeRO stage (partitioning is not a "
                         "precision setting); 1 is the lowest stage whose optimizer runs this loss scaler: set yours")
    elif low and policy.param_dtype == low and policy.distributed.reduce_dtype == low:
        cfg = {"distributed_type": "FSDP", "mixed_precision": mp, "fsdp_config": {}}
    f = policy.fp8
    if f.enabled and mp == "bf16" and f.recipe in ("delayed", "tensorwise"):
        cfg["mixed_precision"] = "fp8"
        if f.recipe == "delayed":
            cfg["fp8_config"] = {"backend": "TE", "fp8_format": "HYBRID" if f.gradient_format == "e5m2" else "E4M3",
                                 "amax_history_len": f.amax_history, "amax_compute_algo": "max"}
        else:
            cfg["fp8_config"] = {"backend": "AO"}
    if mp == "fp16" and cfg.get("distributed_type") != "DEEPSPEED":
        cfg["GradScalerKwargs"] = torch_amp.scaler_kwargs(policy)
    if len(cfg) > 2 or "distributed_type" in cfg or "fp8_config" in cfg:
        text = "".join(f"{k}: {_yaml(v)}\n" for k, v in cfg.items())
    else:
        handler = ""
        if "GradScalerKwargs" in cfg:
            args = ", ".join(f"{k}={v!r}" for k, v in cfg["GradScalerKwargs"].items())
            handler = f", kwargs_handlers=[GradScalerKwargs({args})]"
        text = f"accelerator = Accelerator(mixed_precision={mp!r}{handler})\n"
    out = finish(SYSTEM, policy, cfg, text, lambda c: from_cli(dict(c), "accelerate"))
    return Exported(out.system, out.config, out.text, out.unexpressed + tuple(notes))


def _yaml(v: Any) -> str:
    import json

    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)
