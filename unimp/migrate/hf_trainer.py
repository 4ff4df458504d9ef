"""HF Trainer: the precision arguments of transformers ``TrainingArguments`` (an ``args.json`` /
``to_json_string()`` dict, a YAML file of them such as TRL / alignment-handbook recipes and LLaMA-Factory
``examples/train_*``, or a command line ``--bf16 --deepspeed ds.json``), both directions.

Read from transformers 5.24 (training_args.py, trainer.py; 4.x keys from huggingface/transformers
fd798335c275520af034c678b35e8167820c7c80, the last line with apex):

- training_args.py ``TrainingArguments.__post_init__``: ``mixed_precision`` = "fp16" with ``fp16``, "bf16" with
  ``bf16`` (both is a ValueError, ``_validate_args``); trainer.py ``_build_accelerator_args`` hands it to
  ``Accelerator(mixed_precision=...)``: torch.autocast on the device with a GradScaler for fp16 (Accelerate's
  defaults, no GradScalerKwargs), the output converted to float32 -- imported by :mod:`unimp.migrate.accelerate`.
  The optimizer steps the model's own parameters: float32 unless the model is loaded in a lower dtype
  (``torch_dtype`` / ``dtype`` of the recipe's model arguments): then those, without a float32 copy.
- ``deepspeed`` (a path or a dict): ``HfTrainerDeepSpeedConfig.trainer_config_process`` fills the file's "auto"
  values from these arguments and DeepSpeed runs the precision: imported by :mod:`unimp.migrate.deepspeed` with
  the arguments as its ``assume`` (the same as ``unimp import ds.json --from deepspeed --assume bf16=true``).
- ``fsdp``: Accelerate's FSDP plugin with MixedPrecision(param_dtype = reduce_dtype = the mixed dtype).
- ``fp16_full_eval`` / ``bf16_full_eval``: trainer.py ``evaluation_loop`` casts the model for evaluation only
  (``model.to(dtype=torch.float16)``): not the training numerics (but they fill DeepSpeed's "auto").
- ``tf32``: ``enable_tf32`` (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32): float32 matmuls in TF32.
  A device setting, not an op dtype: unimp holds no key for it; noted (and warned when true).
- 4.x only (removed in 5.0): ``half_precision_backend`` "apex" runs ``amp.initialize(opt_level=fp16_opt_level)``
  instead of Accelerate's autocast (trainer.py ``Trainer.__init__`` use_apex; ``__post_init__`` leaves
  ACCELERATE_MIXED_PRECISION unset for apex) -- imported by :mod:`unimp.migrate.apex`; "cpu_amp" is bf16 CPU
  autocast; ``fp16_opt_level`` is read with apex only.

>>> import_policy({"bf16": True, "learning_rate": 2e-5}).policy.compute_dtype
'bfloat16'
>>> export_policy(import_policy({"fp16": True}).policy).config
{'fp16': True}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unimp.errors import PolicyError, UnimpWarning, UnsupportedError
from unimp.migrate.draft import Exported, Imported, relabel
from unimp.migrate.export_check import finish, merge_into
from unimp.migrate.parsing import pasted_arguments
from unimp.migrate.values import bad, flag, refuse
from unimp.policy import Policy
from unimp.policy.spec import short, show

SYSTEM = "hf_trainer"
BOOLS = ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval", "tf32", "use_cpu", "no_cuda", "torch_compile",
         "pure_bf16", "use_badam", "load_in_4bit", "load_in_8bit", "use_peft")
BACKENDS = ("auto", "apex", "cpu_amp", "cuda_amp", "amp")  # 4.x half_precision_backend (cuda_amp / amp: older)
LEVELS = ("O0", "O1", "O2", "O3")
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "bf16": "bfloat16", "fp16": "float16",
          "fp32": "float32", "half": "float16", "float": "float32"}
PRECISION = ("fp16", "bf16", "fp16_opt_level", "half_precision_backend", "fp16_backend", "tf32", "fp16_full_eval",
             "bf16_full_eval", "deepspeed", "fsdp", "fsdp_config", "use_cpu", "no_cuda", "torch_dtype", "dtype",
             "model_init_kwargs", "torch_compile", "pure_bf16", "use_badam", "load_in_4bit", "load_in_8bit",
             "quantization_bit", "infer_dtype")
OWNED = ("fp16", "bf16", "half_precision_backend", "fp16_backend", "fp16_opt_level", "torch_dtype", "dtype",
         "pure_bf16", "use_cpu", "fsdp")  # what export writes (export --into changes these only)
LLAMA_FACTORY = ("stage", "finetuning_type", "template")  # keys only LLaMA-Factory's own arguments have


def import_policy(args: Mapping[str, Any], *, source: str = "TrainingArguments",
                  base: Path | None = None) -> Imported:
    """The policy HF Trainer trains with under ``args`` (TrainingArguments as a dict; other keys of the
    same file -- model, data, LoRA arguments -- are listed as ignored). ``base``: the directory a relative
    ``deepspeed`` path is also looked up in (the file's own; the current directory first, as HF opens it)."""
    if not isinstance(args, Mapping):
        raise bad(source, "", f"expected TrainingArguments (a table), got {show(args)}")
    a = {k.replace("-", "_"): v for k, v in args.items()}
    on = {k: _truth(source, k, a[k]) for k in BOOLS if k in a and a[k] is not None}
    if on.get("fp16") and on.get("bf16"):
        raise bad(source, "bf16", "true with fp16 true: TrainingArguments raises 'At most one of fp16 and bf16 can be "
                                  "True, but not both' (training_args.py _validate_args); keep one")
    backend = _backend(a, source, on)
    notes: list[str] = []
    rest = tuple(k for k in args if k.replace("-", "_") not in PRECISION)
    lf = any(k in a for k in LLAMA_FACTORY)
    for key in ("load_in_4bit", "load_in_8bit", "quantization_bit"):
        if a.get(key) not in (None, False):
            notes.append(f"{key} = {_val(a[key])}: the frozen base weights are quantized (bitsandbytes); the "
                         f"trainable adapters train as below (the quantized weights not held)")
    tf32 = on.get("tf32")
    if tf32 is not None or (on.get("torch_compile") and not (on.get("fp16") and "tf32" not in a)):
        why = ("tf32 = true" if tf32 else "torch_compile with tf32 unset" if tf32 is None else "tf32 = false")
        on_ = tf32 if tf32 is not None else not on.get("fp16") or on.get("bf16", False)
        if on_:
            notes.append(f"{why}: enable_tf32(True) (training_args.py __post_init__): float32 matmuls and convolutions "
                         f"run in TF32 (10-bit mantissa inputs); unimp has no key for it: set torch.backends.cuda."
                         f"matmul.allow_tf32 = True in your script to match")
            warnings.warn(f"{source}: {notes[-1]}", UnimpWarning, stacklevel=2)
        else:
            notes.append(f"{why}: enable_tf32(False): float32 matmuls in full float32 (torch's default)")
    for key in ("fp16_full_eval", "bf16_full_eval"):
        if on.get(key):
            notes.append(f"{key}: evaluation_loop casts the model to {key[:4]} for evaluation only (trainer.py); "
                         f"not the training numerics")
    mp = "fp16" if on.get("fp16") else "bf16" if on.get("bf16") or on.get("pure_bf16") else "no"
    if on.get("pure_bf16") and not lf:
        raise bad(source, "pure_bf16", "not a TrainingArguments key (LLaMA-Factory's FinetuningArguments); import the "
                                       "LLaMA-Factory file whole (it has stage / finetuning_type)")
    ds = a.get("deepspeed")
    if ds not in (None, "", False):
        return _deepspeed(ds, a, on, backend, source, base, rest, notes)
    if not any(k in a for k in ("fp16", "bf16", "pure_bf16")):
        raise bad(source, "bf16", "not given: the arguments hold no precision setting (no fp16 / bf16 / deepspeed: HF "
                                  "Trainer then runs ACCELERATE_MIXED_PRECISION, 'no' unless the launcher sets it); "
                                  "add bf16: false to import float32")
    if backend == "apex" and mp == "fp16":
        return _apex(a, source, rest, notes)
    if "fp16_opt_level" in a:
        notes.append(f"fp16_opt_level = {_val(a['fp16_opt_level'])}: read with half_precision_backend apex only "
                     f"(transformers 4.x); unused here")
    cpu = bool(on.get("use_cpu") or on.get("no_cuda") or (backend == "cpu_amp" and mp != "no"))
    fsdp = a.get("fsdp")
    launcher = "distributed_type FSDP" if fsdp not in (None, "", False, []) else None
    from unimp.migrate import accelerate

    if launcher:
        if cpu:
            raise refuse(source, "fsdp", "FSDP on CPU is not imported", "import a GPU run")
        fc = a.get("fsdp_config") or {}
        if not isinstance(fc, Mapping):
            raise refuse(source, "fsdp_config", f"{short(fc)}: a path to an FSDP config file is not read",
                         "paste its keys into the arguments as a table")
        cfg = {"distributed_type": "FSDP", "mixed_precision": mp, "fsdp_config": dict(fc)}
        imp = accelerate.import_config(cfg, source=f"{source}: fsdp (Accelerate's FSDP plugin)")
    else:
        imp = accelerate.import_policy(mp, source=source, device="cpu" if cpu else "cuda")
    dtype = _model_dtype(a, source, lf, on)
    why = f"mixed_precision {mp}: Accelerator(mixed_precision={mp!r}) (trainer.py _build_accelerator_args)"
    if lf:
        notes.append("LLaMA-Factory: trainable parameters upcast to float32 (model/adapter.py init_adapter "
                     "cast_trainable_params_to_fp32) unless pure_bf16 / use_badam; frozen weights load in the "
                     "compute dtype (hparams/parser.py) and are not trained")
    if dtype is not None and dtype[0] != "float32" and mp != "no":
        imp = _params(imp, dtype, source)
    elif dtype is not None:
        notes.append(f"{dtype[1]}: the model is loaded in {dtype[0]}")
    if not launcher and mp != "no":
        notes.append("run under `accelerate launch --config_file` with DeepSpeed or FSDP, the launcher's file decides "
                     "the precision: import that file with --from accelerate")
    return relabel(imp, SYSTEM, source, why, rest, _read_keys(args, imp.text, notes))


def _read_keys(args: Mapping[str, Any], text: str, notes: list[str],
               precision: tuple[str, ...] = PRECISION) -> tuple[str, ...]:
    """``notes`` and one line for each precision argument given that no line names yet (read: it changes
    nothing above, e.g. ``torch_dtype: null``, ``use_cpu: false``), so none is dropped silently."""
    said = text + "\n".join(notes)
    extra = [f"{k} = {_val(v)}: read; the default (nothing above changes)" for k, v in args.items()
             if k.replace("-", "_") in precision and k not in said]
    return (*notes, *extra)


def _truth(source: str, key: str, value: Any) -> bool:
    """A boolean argument as HfArgumentParser reads it (string_to_bool: yes/true/t/y/1, no/false/f/n/0)."""
    if isinstance(value, str) and value.lower() in ("yes", "true", "t", "y", "1", "no", "false", "f", "n", "0"):
        return value.lower() in ("yes", "true", "t", "y", "1")
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return flag(source, key, value)


def _val(v: Any) -> str:
    return repr(v) if isinstance(v, bool | int | float) else short(v)


def _backend(a: Mapping[str, Any], source: str, on: Mapping[str, bool]) -> str:
    """``half_precision_backend`` (``fp16_backend``, deprecated, wins when not "auto": 4.x __post_init__)."""
    backend = a.get("half_precision_backend", "auto")
    old = a.get("fp16_backend")
    if old not in (None, "auto"):
        backend = old
    key = "fp16_backend" if old not in (None, "auto") else "half_precision_backend"
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise bad(source, key, f"{short(backend)} is not one of {', '.join(BACKENDS)}")
    if backend == "apex" and on.get("bf16"):
        raise bad(source, key, "apex with bf16: TrainingArguments raises '`--half_precision_backend apex`: GPU bf16 is "
                               "not supported by apex'; use auto")
    return backend


def _model_dtype(a: Mapping[str, Any], source: str, lf: bool, on: Mapping[str, bool]) -> tuple[str, str] | None:
    """The dtype the trained parameters are loaded in, and from which key: the recipe's ``torch_dtype`` /
    ``dtype`` (TRL ModelConfig, ``model_init_kwargs``), LLaMA-Factory's ``pure_bf16`` / ``use_badam``."""
    if lf:
        if on.get("pure_bf16") or on.get("use_badam"):
            key = "pure_bf16" if on.get("pure_bf16") else "use_badam"
            low = "bfloat16" if on.get("pure_bf16") or on.get("bf16") else "float16" if on.get("fp16") else None
            return (low, f"{key}: adapter.py keeps the trainable params in the compute dtype") if low else None
        return None
    kwargs = a.get("model_init_kwargs")
    found = [(k, a[k]) for k in ("torch_dtype", "dtype") if a.get(k) is not None]
    if isinstance(kwargs, Mapping):
        found += [(f"model_init_kwargs.{k}", kwargs[k]) for k in ("torch_dtype", "dtype") if kwargs.get(k) is not None]
    if not found:
        return None
    key, value = found[0]
    name = str(value).removeprefix("torch.")
    if name == "auto":
        raise refuse(source, key, "'auto': the model loads in its checkpoint's saved dtype (from_pretrained), known "
                     "only when it loads; the Trainer's optimizer then steps parameters of that dtype",
                     f"write the dtype the checkpoint holds ({key}: bfloat16, or float32)")
    if name not in DTYPES:
        raise bad(source, key, f"{short(value)} is not a torch dtype name (bfloat16, float16, float32)")
    return DTYPES[name], f"{key} = {_val(value)}: from_pretrained(torch_dtype=...)"


def _params(imp: Imported, dtype: tuple[str, str], source: str) -> Imported:
    """``imp`` with the parameters in ``dtype`` and no float32 copy (the optimizer steps what is loaded)."""
    from unimp.migrate.accelerate import _redraft

    d = _redraft(imp, source, f"{dtype[1]}: the model's parameters in {dtype[0]}, under the autocast below")
    d.set("param_dtype", dtype[0], f"{dtype[1]}: the model's parameters")
    d.set("master_weights.enabled", False, "the Trainer's optimizer steps the loaded parameters (no float32 copy)")
    d.set("distributed.reduce_dtype", dtype[0], "DDP all-reduces the gradients in the parameters' dtype")
    return d.build()


def _deepspeed(ds: Any, a: Mapping[str, Any], on: Mapping[str, bool], backend: str, source: str, base: Path | None,
               rest: tuple[str, ...], notes: list[str]) -> Imported:
    """``deepspeed``: the DeepSpeed config, its "auto" values filled from these arguments."""
    from unimp.migrate import deepspeed

    assume: dict[str, Any] = {k: on[k] for k in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval") if k in on}
    if backend != "auto":
        assume["half_precision_backend"] = backend
    if "fp16_opt_level" in a:
        assume["fp16_opt_level"] = a["fp16_opt_level"]
    where = "deepspeed"
    if isinstance(ds, Mapping):
        cfg: Any = dict(ds)
    elif isinstance(ds, str):
        path = _find(ds, base)
        fix = f"import that file: `unimp import {ds} --from deepspeed --assume {_assume_text(on)}`"
        if path is None:
            raise refuse(source, "deepspeed", f"{short(ds)}: no such file here or next to {short(source)}; the "
                         f"precision is in that DeepSpeed config (its \"auto\" values filled from these arguments)",
                         f"run from the directory the path is relative to, or {fix}")
        try:
            cfg = deepspeed.read_config(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as e:
            raise bad(source, "deepspeed", f"cannot read {short(ds)} ({e})") from None
        where = f"deepspeed = {short(ds)}"
    else:
        raise bad(source, "deepspeed", f"expected a path or a table (the DeepSpeed config), got {show(ds)}")
    imp = deepspeed.import_policy(cfg, source=f"{source}: {where}", assume=assume)
    notes = [*notes, f"{where}: DeepSpeed runs the precision; its \"auto\" values are filled from fp16 / bf16 "
                     f"(integrations/deepspeed.py HfTrainerDeepSpeedConfig.trainer_config_process, Accelerate's "
                     f"DeepSpeedPlugin.set_mixed_precision)"]
    for key in ("torch_dtype", "dtype"):
        if a.get(key) is not None:
            notes.append(f"{key} = {_val(a[key])}: DeepSpeed casts the model itself (module.half() / bfloat16()) and "
                         f"keeps its float32 masters")
    return relabel(imp, SYSTEM, source, where, rest, _read_keys(a, imp.text, notes))


def _assume_text(on: Mapping[str, bool]) -> str:
    return "fp16=true" if on.get("fp16") else "bf16=true" if on.get("bf16") else "fp16=false"


def _find(path: str, base: Path | None) -> Path | None:
    candidates: list[Path] = [Path(path), *([base / path] if base is not None else [])]
    for p in candidates:
        try:
            if p.is_file():
                return p
        except (OSError, ValueError):
            return None
    return None


def _apex(a: Mapping[str, Any], source: str, rest: tuple[str, ...], notes: list[str]) -> Imported:
    """4.x ``half_precision_backend apex``: ``amp.initialize(model, optimizer, opt_level=fp16_opt_level)``."""
    from unimp.migrate import apex

    level = a.get("fp16_opt_level", "O1")
    if not isinstance(level, str) or level not in LEVELS:
        raise bad(source, "fp16_opt_level", f"{short(level)} is not one of {', '.join(LEVELS)}")
    imp = apex.import_policy(level, source=f"{source}: fp16_opt_level {level}")
    return relabel(imp, SYSTEM, source, f"half_precision_backend apex: trainer.py _wrap_model calls amp.initialize("
                   f"opt_level={level!r}) (transformers 4.x)", rest, _read_keys(a, imp.text, notes))


def parse_command_line(text: str, source: str) -> dict[str, Any]:
    """``--bf16 --deepspeed ds.json --learning_rate 2e-5`` as HfArgumentParser reads it: a boolean flag alone is
    true (``nargs="?", const=True``) or takes yes/no/true/false/1/0; ``-`` in a name is ``_``; the command and
    its script (``torchrun train.py``), shell variables and line continuations as the shell reads them."""
    from unimp.migrate.megatron import _expand, _words

    words, assigned, _, _ = _words(text, source)
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = _expand(words[i], assigned)
        i += 1
        if not word.startswith("--"):
            continue
        key, eq, value = word[2:].partition("=")
        key = key.replace("-", "_")
        if key in out:
            raise bad(source, f"--{key}", "given twice; HfArgumentParser keeps the last, easy to miss: keep one")
        if eq:
            out[key] = value
        elif i < len(words) and not words[i].startswith("-"):  # argparse nargs="?" takes it (a bool: string_to_bool)
            out[key], i = _expand(words[i], assigned), i + 1
        else:
            out[key] = True
    if not out:
        raise bad(source, "", f"cannot read {short(text)}: expected TrainingArguments (--bf16, --fp16, --deepspeed "
                              f"ds.json ...) or their JSON / YAML file")
    return out


def from_cli(raw: Any, source: str) -> Imported:
    base = Path(source).parent if source not in ("<argument>", SYSTEM) else None
    raw = pasted_arguments(raw, source, parse_command_line,
                           "TrainingArguments (--bf16 ..., a JSON table or YAML lines bf16: true)")
    return import_policy(raw, source=source, base=base)


def export_policy(policy: Policy, into: Mapping[str, Any] | None = None) -> Exported:
    """TrainingArguments keys for the policy (``{"bf16": true}``, ``{"fp16": true}``, apex's 4.x
    ``half_precision_backend`` / ``fp16_opt_level``, ``torch_dtype`` for parameters stepped in a low dtype);
    the candidate that re-imports closest. ``into``: the user's arguments file, only these keys changed."""
    import json

    def closest(candidates: list[dict[str, Any]]) -> Exported:
        outs = []
        for c in candidates:
            try:
                outs.append(finish(SYSTEM, policy, c, "", lambda x: import_policy(x, source="export")))
            except (PolicyError, UnsupportedError):  # a candidate the system refuses (fp16 on CPU)
                continue
        return min(outs, key=lambda o: len(o.unexpressed))

    mp = {"float16": "fp16", "bfloat16": "bf16"}.get(policy.compute_dtype)
    if mp is None:
        cands: list[dict[str, Any]] = [{"fp16": False, "bf16": False}]
    else:
        cands = [{mp: True}, {mp: True, "torch_dtype": policy.compute_dtype}, {mp: True, "use_cpu": True},
                 {mp: True, "fsdp": "full_shard"}]
        if mp == "fp16":
            cands += [{"fp16": True, "half_precision_backend": "apex", "fp16_opt_level": lvl} for lvl in LEVELS[1:]]
    from unimp.migrate import deepspeed

    ds = deepspeed.export_policy(policy)
    cands.append({**({mp: True} if mp else {}), "deepspeed": ds.config})  # TrainingArguments takes the dict
    best = closest(cands)
    cfg = dict(best.config)
    changed: tuple[str, ...] = ()
    stage = tuple(f"deepspeed.{u}" for u in ds.unexpressed if u.startswith("zero_optimization.stage"))
    unexpressed = best.unexpressed + (stage if "deepspeed" in cfg else ())
    if into is not None:
        cfg, changed = merge_into(into, cfg, OWNED)
        try:
            again = finish(SYSTEM, policy, cfg, "", lambda x: import_policy(x, source="export --into"))
            unexpressed = again.unexpressed
        except (PolicyError, UnsupportedError) as e:  # e.g. its deepspeed file is not here: that file decides
            unexpressed = (f"the merged arguments cannot be checked ({e})",)
    text = json.dumps(cfg, indent=2) + "\n" if into is not None else _flags(cfg)
    return Exported(SYSTEM, cfg, text, unexpressed, changed)


def _flags(cfg: Mapping[str, Any]) -> str:
    """The arguments as a command line and as a JSON/YAML table (``torch_dtype`` is a model argument)."""
    line = " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in cfg.items() if k != "torch_dtype")
    yaml = "".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in cfg.items())
    return f"# command line: {line}\n{yaml}"
