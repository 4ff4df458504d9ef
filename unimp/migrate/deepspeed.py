"""DeepSpeed: the ``fp16`` / ``bf16`` / ``amp`` / ``zero_optimization`` / ``communication_data_type``
sections of a DeepSpeed JSON config, both directions, read as the engine reads them.

Sources (microsoft/DeepSpeed at 38327e07f6cd39b63418f60cedd1651b0be3e7c3):

- deepspeed/runtime/engine.py ``DeepSpeedEngine._configure_distributed_model``: ``module.half()``
  (fp16) or ``module.bfloat16()`` (bf16): the whole model, every op and its output, runs in the low
  dtype; no op list keeps float32. The fp32 masters live in the optimizer wrapper
  (``_configure_fp16_optimizer`` / ``_configure_bf16_optimizer`` / ``_configure_zero_optimizer``).
- engine.py ``communication_data_type``: gradients are reduced in fp16 / bf16 unless
  ``communication_data_type`` (``fp16`` | ``bf16`` | ``fp32``, runtime/config.py
  ``get_communication_data_type``) says otherwise.
- runtime/constants.py: loss_scale 0 (dynamic), initial_scale_power 16, loss_scale_window 1000,
  hysteresis 2, consecutive_hysteresis false, min_loss_scale 1. Without ZeRO the engine builds
  ``FP16_Optimizer`` (fp16/fused_optimizer.py ``_update_scale``: no hysteresis, clamps at
  min_loss_scale); under ZeRO 1-3 ``DynamicLossScaler`` (fp16/loss_scaler.py): hysteresis counted,
  refilled on growth (or every clean step with consecutive_hysteresis), raises at the minimum.
- ``"auto"`` values are what HF Trainer fills in (transformers/integrations/deepspeed.py,
  ``HfTrainerDeepSpeedConfig.trainer_config_process``): ``fp16.enabled`` = (fp16 or fp16_full_eval)
  with the amp backend, ``bf16.enabled`` = bf16 or bf16_full_eval, ``amp.enabled`` = the apex
  backend, ``amp.opt_level`` = fp16_opt_level; pass the Trainer arguments as ``assume``.

Other top-level keys (batch sizes, optimizer, scheduler, ...) are not precision settings: they
are listed as ignored. Unknown keys inside ``fp16`` / ``bf16`` are errors.

>>> imp = import_policy({"fp16": {"enabled": True, "loss_scale_window": 500}, "zero_optimization": {"stage": 2}})
>>> imp.policy.loss_scale.growth_interval, imp.policy.loss_scale.hysteresis, imp.policy.output_dtype
(500, 2, 'float16')
>>> import_policy({"bf16": {"enabled": "auto"}}, assume={"bf16": True}).policy.param_dtype
'bfloat16'
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from unimp.migrate.draft import Draft, Exported, Imported, has_knob, relabel, take
from unimp.migrate.export_check import finish, merge_into
from unimp.migrate.parsing import plain
from unimp.migrate.values import bad, check_keys, flag, number, power_of_two, refuse
from unimp.policy import Policy
from unimp.policy.spec import short, show

SYSTEM = "deepspeed"
FP16_KEYS = ("enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
BF16_KEYS = ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads")
PRECISION = ("fp16", "bf16", "bfloat16", "zero_optimization", "communication_data_type", "amp", "torch_autocast",
             "data_types", "msamp", "compression_training", "quantize_training", "seq_parallel_communication_data_type")
COMM = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # runtime/config.py get_communication_data_type
LOW = {"float16": "fp16", "bfloat16": "bf16"}
# Top-level keys that change numerics outside the AMP policy: noted (and warned) with why unimp does not hold them
OUTSIDE = {"compression_training": "DeepSpeed Compression (quantization-aware training / pruning) changes the model, "
                                   "not its mixed precision",
           "quantize_training": "MoQ weight quantization changes the model, not its mixed precision",
           "seq_parallel_communication_data_type": "the sequence-parallel (Ulysses) reduce dtype: unimp's reduce dtype "
                                                   "is the data-parallel one"}
QUANTIZED_COMM = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
# transformers TrainingArguments defaults (training_args.py) for the arguments "auto" reads
TRAINER_DEFAULTS: dict[str, Any] = {"fp16": False, "bf16": False, "fp16_full_eval": False, "bf16_full_eval": False,
                                    "fp16_backend": "auto", "half_precision_backend": "auto", "fp16_opt_level": "O1"}
AUTO_FIX = ("HF Trainer fills it from its arguments (transformers integrations/deepspeed.py, HfTrainerDeepSpeedConfig."
            "trainer_config_process); pass them: `unimp import FILE --from deepspeed --assume fp16=true` "
            "(or bf16=true, or fp16=false for float32)")


def _val(v: Any) -> str:
    """A source value for a note: numbers and booleans as written, anything else quoted and bounded."""
    return repr(v) if isinstance(v, bool | int | float) else short(v)


def trainer_args(assume: Mapping[str, Any] | None, source: str) -> dict[str, Any] | None:
    """The Trainer arguments ``"auto"`` resolves from (TrainingArguments defaults for those not given)."""
    if assume is None:
        return None
    check_keys(assume, TRAINER_DEFAULTS, source, "--assume ")
    out = dict(TRAINER_DEFAULTS)
    for key, value in assume.items():
        if key in ("fp16_backend", "half_precision_backend", "fp16_opt_level"):
            if not isinstance(value, str):
                raise bad(source, f"--assume {key}", f"expected a name, got {show(value)}")
            out[key] = value
        else:
            out[key] = _truth(value, source, f"--assume {key}")
    return out


def _truth(value: Any, source: str, key: str) -> bool:
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    return flag(source, key, value)


def resolve_auto(config: Mapping[str, Any], args: Mapping[str, Any] | None, source: str) -> dict[str, Any]:
    """``config`` with the precision ``"auto"`` values replaced as HF Trainer replaces them."""
    cfg = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in config.items()}
    backend = (args or {}).get("half_precision_backend", "auto")
    backend = (args or {}).get("fp16_backend", "auto") if backend == "auto" else backend
    for sec, key in (("fp16", "enabled"), ("bf16", "enabled"), ("bfloat16", "enabled"), ("amp", "enabled"),
                     ("amp", "opt_level")):
        table = cfg.get(sec)
        if not isinstance(table, dict) or (args is None and table.get(key) != "auto"):
            continue
        if args is None:
            raise bad(source, f"{sec}.{key}", f'"auto": {AUTO_FIX}')
        half = args["fp16"] or args["fp16_full_eval"]
        hf = {("fp16", "enabled"): half and backend != "apex", ("amp", "enabled"): half and backend == "apex",
              ("amp", "opt_level"): args["fp16_opt_level"]}.get((sec, key), args["bf16"] or args["bf16_full_eval"])
        if table.get(key) == "auto":
            table[key] = hf
        elif key in table and table[key] != hf and sec != "bfloat16":  # HfTrainerDeepSpeedConfig.fill_match
            raise bad(source, f"{sec}.{key}", f"{_val(table[key])} while the Trainer arguments give {_val(hf)}: HF "
                      f"Trainer refuses the run (integrations/deepspeed.py trainer_config_finalize: 'Please correct "
                      f"the following DeepSpeed config values that mismatch TrainingArguments values'); make "
                      f"--assume match the file, or set {sec}.{key} to \"auto\"")
    for sec in ("fp16", "bf16", "bfloat16", "amp"):
        for key, value in (cfg.get(sec) or {}).items() if isinstance(cfg.get(sec), dict) else ():
            if value == "auto":
                raise bad(source, f"{sec}.{key}", '"auto" is not filled by HF Trainer for this key (only fp16.enabled, '
                                                  'bf16.enabled, amp.enabled and amp.opt_level are); DeepSpeed would '
                                                  'fail on it: write the value')
    if cfg.get("communication_data_type") == "auto":
        raise bad(source, "communication_data_type", '"auto" is not filled by HF Trainer; write fp16, bf16 or fp32')
    if args is not None:
        _accelerate_adds(cfg, "no" if backend == "apex" else "fp16" if args["fp16"] else "bf16" if args["bf16"] else
                         "no", source)
    return cfg


def _accelerate_adds(cfg: dict[str, Any], mp: str, source: str) -> None:
    """The section HF Trainer's Accelerate adds: transformers training_args.py ``__post_init__`` sets
    ACCELERATE_MIXED_PRECISION to fp16 / bf16 (not with the apex backend) and accelerate
    utils/dataclasses.py ``DeepSpeedPlugin.set_mixed_precision`` writes ``fp16: {enabled, auto_cast}`` /
    ``bf16: {enabled}`` when the config lacks it, and raises when the other one is enabled."""
    if mp == "no":
        return
    other = "bf16" if mp == "fp16" else "fp16"
    table = cfg.get(other)
    if isinstance(table, Mapping) and str(table.get("enabled", "False")).lower() == "true":
        raise bad(source, f"{other}.enabled", f"true while the Trainer runs {mp} (--assume {mp}=true): Accelerate's "
                                              f"DeepSpeedPlugin.set_mixed_precision raises \"`--mixed_precision` arg "
                                              f"cannot be set to `{mp}` when `{other}` is set in the DeepSpeed config "
                                              f"file\"; drop one")
    if mp not in cfg:
        cfg[mp] = {"enabled": True, "auto_cast": True} if mp == "fp16" else {"enabled": True}
        cfg.setdefault("__added__", []).append(mp)


def import_policy(config: Mapping[str, Any], *, source: str = "deepspeed config",
                  assume: Mapping[str, Any] | None = None, model: Callable[[Draft], None] | None = None) -> Imported:
    """The policy a DeepSpeed engine built from ``config`` trains with (``assume``: HF Trainer
    arguments that ``"auto"`` values resolve from, e.g. ``{"bf16": True}``; ``model``: what the
    model code run under the engine adds, e.g. Megatron's float32 loss, applied to the draft)."""
    if not isinstance(config, Mapping):
        raise bad(source, "", "expected a JSON object (the DeepSpeed config)")
    config = plain(config, source)  # the bounds of every source (the CLI's too): size, depth, value types
    config = resolve_auto(config, trainer_args(assume, source), source)
    added = config.pop("__added__", [])
    fp16 = _section(config, "fp16", source)
    bf16_key = "bf16" if "bf16" in config else "bfloat16"  # get_bfloat16_enabled: "bf16" first
    bf16 = _section(config, bf16_key, source)
    check_keys(fp16, FP16_KEYS, source, "fp16.")
    check_keys(bf16, BF16_KEYS, source, f"{bf16_key}.")
    stage = _stage(config, source)
    fp16_on = flag(source, "fp16.enabled", fp16.get("enabled", False))
    bf16_on = flag(source, f"{bf16_key}.enabled", bf16.get("enabled", False))
    amp = _section(config, "amp", source)
    if amp and flag(source, "amp.enabled", amp.get("enabled", False)):
        return _amp(config, amp, stage, fp16_on or bf16_on, source)
    if _section(config, "torch_autocast", source).get("enabled"):
        raise refuse(source, "torch_autocast.enabled", "DeepSpeed's torch_autocast mode is not imported",
                     "use the fp16 or bf16 section (the engine's whole-model low precision) instead")
    if fp16_on and bf16_on:
        raise bad(source, "fp16.enabled", "fp16 and bf16 are both enabled (DeepSpeed refuses this); enable one")
    for sec, key in (("fp16", "fp16_master_weights_and_grads"), (bf16_key, "bf16_master_weights_and_grads")):
        if (fp16 if sec == "fp16" else bf16).get(key):
            raise refuse(source, f"{sec}.{key}", "master weights in the low dtype are not expressible (unimp keeps "
                         "float32 masters)", f"remove {key}")
    if fp16_on:
        d = _fp16(fp16, stage, source)
        low = "float16"
    elif bf16_on:
        low = "bfloat16"
        d = Draft(SYSTEM, source, "deepspeed_bf16", f"{bf16_key}.enabled: engine.py _configure_distributed_model "
                  f"calls module.bfloat16(); fp32 masters in the optimizer")
        check = flag(source, f"{bf16_key}.check_grad_overflow", bf16.get("check_grad_overflow", False))
        d.set("loss_scale.skip_nonfinite", check, f"{bf16_key}.check_grad_overflow" if "check_grad_overflow" in bf16
              else f"{bf16_key}.check_grad_overflow not given: false (every step is taken)")
        if "immediate_grad_update" in bf16:
            d.note(f"{bf16_key}.immediate_grad_update: when the optimizer applies gradients, not a dtype (ignored)")
    else:
        fp16_given = "fp16" in config or "bf16" in config or "bfloat16" in config
        if not fp16_given and "communication_data_type" not in config:
            raise bad(source, "fp16", "not given: the config holds no precision setting (no fp16 / bf16 / amp section: "
                                      "DeepSpeed then trains in float32); to import float32 add \"fp16\": "
                                      "{\"enabled\": false}")
        d = Draft(SYSTEM, source, "fp32", "neither fp16 nor bf16 enabled: engine.py keeps the module in float32")
        low = "float32"
    comm = config.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in COMM:
            raise bad(source, "communication_data_type", f"{show(comm)} is not one of fp16, bf16, fp32 (runtime/"
                                                         f"config.py get_communication_data_type raises on it)")
        d.set("distributed.reduce_dtype", COMM[comm.lower()], "communication_data_type")
    elif low != "float32":
        d.set("distributed.reduce_dtype", low, "communication_data_type not given: engine.py "
              f"communication_data_type defaults to the model's {LOW[low]}")
    for sec in added:
        d.note(f"{sec}: not in the file; with --assume {sec}=true HF Trainer's Accelerate adds "
               f"{json.dumps(config[sec])} (accelerate utils/dataclasses.py DeepSpeedPlugin.set_mixed_precision)")
    if stage:
        d.note(f"zero_optimization.stage = {stage}: selects the ZeRO optimizer (its loss scaler, above); the "
               f"partitioning itself is not a precision setting")
    elif "zero_optimization" in config:
        d.note("zero_optimization.stage = 0: no ZeRO (the plain engine's optimizer wrapper, above)")
    for sec in ("fp16", "bf16", "bfloat16"):
        if sec in config and not (fp16_on if sec == "fp16" else bf16_on and sec == bf16_key):
            rest = [k for k in config[sec] if k != "enabled"] if isinstance(config[sec], Mapping) else []
            d.note(f"{sec}: not enabled (its enabled is false or it is shadowed by \"bf16\"), so DeepSpeed does not "
                   f"read its other keys{' (' + ', '.join(rest) + ')' if rest else ''}")
    dt = config.get("data_types")
    if isinstance(dt, Mapping) and dt.get("grad_accum_dtype") is not None:
        d.note(f"data_types.grad_accum_dtype = {show(dt['grad_accum_dtype'])}: the dtype gradients are accumulated in "
               f"across micro-batches has no unimp key (ignored)", warn=True)
    for key, why in OUTSIDE.items():
        if key in config:
            d.note(f"{key}: {why} (not held)", warn=True)
    msamp = config.get("msamp")
    if isinstance(msamp, Mapping) and msamp.get("enabled"):
        raise refuse(source, "msamp.enabled", "MS-AMP keeps weights and optimizer states in FP8/FP16; unimp keeps "
                     "float32 masters", "remove the msamp section (or keep this run in DeepSpeed)")
    zero = config.get("zero_optimization")
    if isinstance(zero, Mapping):
        for key in QUANTIZED_COMM:
            if zero.get(key):
                raise refuse(source, f"zero_optimization.{key}", "ZeRO++ quantized communication (int8 weights / "
                             "int4 gradients on the wire) has no unimp key", f"remove {key}")
        # offload, buckets, prefetch...: where and when, not in which dtype
        d.ignored.extend(f"zero_optimization.{k}" for k in zero if k != "stage")
    d.ignored.extend(k for k in config if k not in PRECISION)
    if model is not None:
        model(d)
    return d.build()


def _amp(config: Mapping[str, Any], amp: Mapping[str, Any], stage: int, low: bool, source: str) -> Imported:
    """``"amp": {"enabled": true, ...}``: engine.py _configure_optimizer calls ``apex.amp.initialize(model,
    optimizer, **amp_params)`` (amp_params: the section without ``enabled``)."""
    from unimp.migrate import apex

    if stage:
        raise bad(source, "amp.enabled", "amp with ZeRO (engine.py _do_optimizer_sanity_check asserts 'Amp and ZeRO "
                                         "are not currently compatible'); remove one")
    if low:
        raise bad(source, "amp.enabled", "amp with fp16/bf16 enabled (engine.py raises 'Cannot enable both amp with "
                                         "(legacy) fp16 or bfloat16 mode'); remove one")
    params = {k: v for k, v in amp.items() if k != "enabled"}
    level = params.pop("opt_level", "O1")
    imp = apex.import_policy(level, source=f"{source}: amp", **params)
    ignored = tuple(k for k in config if k not in PRECISION)
    return relabel(imp, SYSTEM, source, "its amp section (apex)", ignored)


def _section(config: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    sec = config.get(key) or {}
    if not isinstance(sec, Mapping):
        raise bad(source, key, "expected a JSON object")
    return sec


def _stage(config: Mapping[str, Any], source: str) -> int:
    zero = config.get("zero_optimization", {})
    if isinstance(zero, bool):
        return int(zero)
    if not isinstance(zero, Mapping):
        raise bad(source, "zero_optimization", "expected a JSON object")
    stage: int = number(source, "zero_optimization.stage", zero.get("stage", 0), int, minimum=0)
    if stage > 3:
        raise bad(source, "zero_optimization.stage", f"{stage}: ZeRO stages are 0-3")
    return stage


def _fp16(fp16: Mapping[str, Any], stage: int, source: str) -> Draft:
    p = "fp16."
    zero = stage > 0
    why = "engine.py _configure_distributed_model calls module.half(); fp32 masters in the optimizer"
    if zero:
        d = Draft(SYSTEM, source, "deepspeed_zero_fp16", f"fp16.enabled with ZeRO stage {stage}: {why}; "
                  f"loss_scaler.py DynamicLossScaler")
    else:
        d = Draft(SYSTEM, source, "deepspeed_fp16", f"fp16.enabled without ZeRO: {why}; fused_optimizer.py "
                  f"FP16_Optimizer")
    if "auto_cast" in fp16:
        flag(source, "fp16.auto_cast", fp16["auto_cast"])
        d.note("fp16.auto_cast: the engine casts floating inputs to fp16 (engine.py forward); unimp casts each op's "
               "inputs to the policy's dtype: the same numerics")
    static = number(source, "fp16.loss_scale", fp16.get("loss_scale", 0), minimum=0)
    if static > 0:
        d.set("loss_scale.mode", "static", "fp16.loss_scale > 0: static scale")
        d.set("loss_scale.initial", static, "fp16.loss_scale")
        for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                    "min_loss_scale"):
            if key in fp16:
                d.note(f"fp16.{key} is unused with a static fp16.loss_scale (ignored)")
        return d
    d.set("loss_scale.mode", "dynamic", "fp16.loss_scale = 0" if "loss_scale" in fp16 else
          "fp16.loss_scale not given: 0 (dynamic)")
    take(d, "loss_scale.initial", fp16, "initial_scale_power", 16, kind=int, prefix=p, minimum=-126,
         convert=lambda k: 2.0 ** k)
    take(d, "loss_scale.growth_interval", fp16, "loss_scale_window", 1000, kind=int, prefix=p)
    take(d, "loss_scale.min", fp16, "min_loss_scale", 1.0, prefix=p)
    d.set("loss_scale.growth_factor", 2.0, "DeepSpeed scale_factor 2 (fixed)")
    d.set("loss_scale.backoff_factor", 0.5, "DeepSpeed scale_factor 2 (fixed)")
    d.set("loss_scale.max", float("inf"), "DeepSpeed has no cap")
    if zero:
        take(d, "loss_scale.hysteresis", fp16, "hysteresis", 2, kind=int, prefix=p, minimum=1)
        take(d, "loss_scale.hysteresis_refill", fp16, "consecutive_hysteresis", False, kind=bool, prefix=p,
             convert=lambda c: ["finite", "growth"] if c else ["growth"])
        d.set("loss_scale.at_min", "error", "DynamicLossScaler raises at the minimum")
    else:
        for key in ("hysteresis", "consecutive_hysteresis"):
            if key in fp16:
                d.note(f"fp16.{key} = {_val(fp16[key])} is ignored by DeepSpeed without ZeRO (FP16_Optimizer has no "
                       f"hysteresis); set zero_optimization.stage >= 1 to use it", warn=True)
        d.set("loss_scale.hysteresis", 1, "FP16_Optimizer has no hysteresis")
        d.set("loss_scale.at_min", "clamp", "FP16_Optimizer stays at min_loss_scale")
    if has_knob("loss_scale.scale_dtype"):
        d.set("loss_scale.scale_dtype", "float64", "DeepSpeed holds the scale as a Python float")
    return d


OWNED = ("fp16", "bf16", "bfloat16", "amp", "torch_autocast", "communication_data_type")  # what export writes


def export_policy(policy: Policy, into: Mapping[str, Any] | None = None) -> Exported:
    """A DeepSpeed config (``fp16``/``bf16``, ``zero_optimization.stage``, ``communication_data_type``).

    ``into``: the user's own config, of which only the precision keys (``OWNED``) change; every other
    key (``zero_optimization`` with its stage, batch sizes, optimizer...) is kept verbatim, and what
    re-importing the merged config does not give back is listed as not expressed.

    Without ``into`` the policy holds no ZeRO stage: a policy with the ZeRO optimizers' loss scaler
    is written with ``"zero_optimization": {"stage": 1}`` (the lowest stage that runs it) and that is
    listed as not expressed, so ``--strict`` fails until the user names the stage (or passes ``into``).
    """
    cfg: dict[str, Any] = {}
    notes: list[str] = []
    ls = policy.loss_scale
    low = policy.compute_dtype if policy.compute_dtype in LOW else None
    zero = False
    if policy.compute_dtype == "float16":
        sec: dict[str, Any] = {"enabled": True}
        if ls.mode == "static":
            sec["loss_scale"] = ls.initial
        elif ls.mode == "dynamic":
            power = power_of_two(ls.initial)
            sec.update(loss_scale=0, initial_scale_power=power if power is not None else 16,
                       loss_scale_window=ls.growth_interval, min_loss_scale=ls.min)
            zero = ls.hysteresis > 1 or ls.at_min == "error"
            if zero:
                sec.update(hysteresis=ls.hysteresis, consecutive_hysteresis="finite" in ls.hysteresis_refill)
        cfg["fp16"] = sec
    elif policy.compute_dtype == "bfloat16":
        cfg["bf16"] = {"enabled": True, **({"check_grad_overflow": True} if ls.skip_nonfinite else {})}
    else:
        cfg["fp16"] = {"enabled": False}  # float32: an explicit setting (an empty config is refused on import)
    if low is not None and policy.distributed.reduce_dtype != low:
        cfg["communication_data_type"] = {"float32": "fp32", **LOW}[policy.distributed.reduce_dtype]
    changed: tuple[str, ...] = ()
    if into is not None:
        cfg, changed = merge_into(into, cfg, OWNED)
        given = into.get("zero_optimization")
        if zero and _stage(into, "--into") == 0:  # the loss scaler needs a ZeRO optimizer: the lowest stage
            cfg["zero_optimization"] = {**(given if isinstance(given, Mapping) else {}), "stage": 1}
            changed += ("zero_optimization.stage (set to 1)",)
            notes.append("zero_optimization.stage = 0 in --into: the policy's loss scaler (hysteresis, raise at the "
                         "minimum) is the ZeRO optimizers' DynamicLossScaler, so the stage was set to 1 (the lowest "
                         "that runs it); a partitioning change is yours to make: set the stage in your file")
    elif zero:
        cfg["zero_optimization"] = {"stage": 1}
        notes.append("zero_optimization.stage = 1: the policy holds no ZeRO stage (partitioning is not a "
                     "precision setting); 1 is the lowest stage whose optimizer runs this loss scaler "
                     "(DynamicLossScaler): set the stage your run uses (1, 2 or 3 give the same numerics), or "
                     "export --into your config to keep its own")
    out = finish(SYSTEM, policy, cfg, json.dumps(cfg, indent=2) + "\n", import_policy)
    return Exported(out.system, out.config, out.text, out.unexpressed + tuple(notes), changed)


def read_config(text: str, source: str) -> Any:
    """A DeepSpeed config's text as DeepSpeed reads it (runtime/config.py ``DeepSpeedConfig.__init__``:
    ``hjson.load(..., object_pairs_hook=dict_raise_error_on_duplicate_keys)``): JSON plus ``//``, ``#``
    and ``/* */`` comments, duplicate keys refused.

    >>> read_config('{"fp16": {"enabled": true}  /* an fp16 run */ }', "ds.json")
    {'fp16': {'enabled': True}}
    """
    import hjson

    def table(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise bad(source, key, "given twice in one table (DeepSpeed refuses duplicate keys: "
                                       "dict_raise_error_on_duplicate_keys); keep one")
            out[key] = value
        return out

    try:  # plain JSON first: its numbers as written (hjson reads 1.0 as 1), kept so by export --into
        return json.loads(text, object_pairs_hook=table)
    except ValueError:
        pass
    except RecursionError:
        raise bad(source, "", "nested too deeply; a DeepSpeed config is a few levels deep") from None
    try:
        return hjson.loads(text, object_pairs_hook=table)
    except hjson.HjsonDecodeError as e:
        raise bad(source, "", f"not a DeepSpeed config (DeepSpeed reads JSON with comments, hjson: {e})") from None
    except RecursionError:
        raise bad(source, "", "nested too deeply; a DeepSpeed config is a few levels deep") from None


def from_cli(raw: Any, source: str, assume: Mapping[str, Any] | None = None) -> Imported:
    if isinstance(raw, str):
        raw = plain(read_config(raw, source), source)
    return import_policy(raw, source=source, assume=assume)
