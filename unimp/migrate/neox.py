"""GPT-NeoX: the precision keys of a NeoX YAML config (``precision``, the ``fp16`` / ``bf16`` blocks,
``zero_optimization``, ``fp16_lm_cross_entropy``, ``attention_softmax_in_fp32``, ``fp32_allreduce``),
both directions, read as NeoX and its DeepSpeed read them.

Read from EleutherAI/gpt-neox ea7aefd8f8e183256992d9fede4d7c71a46d67a5:

- megatron/neox_arguments/arguments.py ``NeoXArgs.from_ymls``: ``yaml.load(..., FullLoader)`` (Python's
  ``True``, trailing commas and ``#`` comments are YAML), ``-`` in a key read as ``_``;
  ``calculate_derived``: an enabled ``fp16`` block sets ``precision`` fp16, an enabled ``bf16`` block
  bfloat16 (a conflicting ``precision`` is an assertion error); ``precision: fp16`` hands DeepSpeed the
  ``fp16`` block (``{"type": "fp16", "enabled": true}`` without one), ``precision: bfloat16`` adds
  ``bf16: {"enabled": true}`` when there is no ``bf16`` block; anything else trains in fp32.
  ``ZERO_DEFAULTS``: stage 0.
- The DeepSpeed engine (EleutherAI/DeeperSpeed 91d1c55ba037b5ada99ae14884dff87a4dc5b9ea, pinned by
  requirements/requirements.txt) then runs the whole model in that dtype with its loss scaler
  (:mod:`unimp.migrate.deepspeed`); its config.py reads only the DeepSpeed keys of those blocks
  (``fp16.type``, ``fp16.fp16``, a ``bf16`` block's loss-scale keys are not read).
- megatron/model/gpt2_model.py ``cross_entropy``: ``vocab_parallel_cross_entropy(output.float()...)``
  unless ``fp16_lm_cross_entropy`` (fp16 only, arguments.py ``validate_values``): the LM loss runs on
  float32 logits; the logits themselves stay in the model dtype (no cast after the last layer).
- megatron/model/transformer.py ``ParallelSelfAttention``: ``FusedScaleMaskSoftmax(softmax_in_fp32=
  attention_softmax_in_fp32)``, forced on by ``apply_query_key_layer_scaling``.
- ``fp32_allreduce`` upcasts the tensor-parallel all-reduces only (megatron/mpu/mappings.py
  ``_reduce``); DeeperSpeed does not read it, so the data-parallel gradient reduce is DeepSpeed's
  (``communication_data_type``, default the model dtype).

>>> imp = import_policy({"precision": "bfloat16", "zero_optimization": {"stage": 1}, "num_layers": 12})
>>> imp.policy.param_dtype, imp.policy.ops.category("loss"), imp.ignored
('bfloat16', 'float32', ('num_layers',))
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from unimp.errors import UnimpWarning
from unimp.migrate import deepspeed
from unimp.migrate.draft import Draft, Exported, Imported, relabel
from unimp.migrate.export_check import finish, merge_into
from unimp.migrate.parsing import pasted_yaml
from unimp.migrate.values import bad, flag
from unimp.policy import Policy
from unimp.policy.spec import short, show

SYSTEM = "neox"
PRECISIONS = ("fp16", "fp32", "bfloat16")  # neox_args.py NeoXArgsModel.precision
OWN = ("precision", "fp16_lm_cross_entropy", "attention_softmax_in_fp32", "apply_query_key_layer_scaling",
       "fp32_allreduce", "deepspeed_extra_args")  # NeoX's own precision keys (the rest of the blocks are DeepSpeed's)
OWNED = ("precision", "fp16", "bf16", "amp", "communication_data_type", "fp16_lm_cross_entropy",
         "attention_softmax_in_fp32")  # what export writes (export --into changes these only)
NOT_READ = {"type": "DeeperSpeed's config.py reads fp16.enabled and the loss-scale keys, not 'type'",
            "fp16": "not a DeepSpeed key of the block", "bf16": "not a DeepSpeed key of the block"}


def import_policy(config: Mapping[str, Any], *, source: str = "neox config") -> Imported:
    """The policy of a GPT-NeoX run configured by ``config`` (one YAML file, parsed)."""
    if not isinstance(config, Mapping):
        raise bad(source, "", f"expected a NeoX YAML config (a table), got {show(config)}")
    cfg = {k.replace("-", "_"): v for k, v in config.items()}
    extra = cfg.get("deepspeed_extra_args") or {}
    if not isinstance(extra, Mapping):
        raise bad(source, "deepspeed_extra_args", f"expected a table, got {show(extra)}")
    precision = cfg.get("precision")
    if precision is not None and (not isinstance(precision, str) or precision not in PRECISIONS):
        raise bad(source, "precision", f"{short(precision)} is not one of {', '.join(PRECISIONS)} "
                                       f"(neox_args.py precision)")
    blocks = {k: _block(cfg, k, source) for k in ("fp16", "bf16")}
    for key, want in (("fp16", "fp16"), ("bf16", "bfloat16")):
        if blocks[key] and flag(source, f"{key}.enabled", blocks[key].get("enabled", False)):
            if precision not in (None, want):
                raise bad(source, "precision", f"{short(precision)} while the {key} block is enabled: NeoX asserts "
                                               f"'DeepSpeed {key} field was set but precision conflicts' "
                                               f"(arguments.py calculate_derived); make them match")
            precision = want
    if precision is None and not any(k in cfg for k in ("fp16", "bf16", "amp")):
        raise bad(source, "precision", "not given, and no fp16 / bf16 block: NeoX merges every YAML file the run "
                                       "is given (deepy.py train.py a.yml b.yml), and trains in fp32 only when "
                                       "none sets it; import the file that sets the precision, or add "
                                       "precision: \"fp32\" to import float32")
    notes: list[str] = []
    spelled = {k.replace("-", "_"): k for k in config}  # other keys listed as the file spells them
    ds = {(k if k in deepspeed.PRECISION else spelled[k]): v for k, v in cfg.items() if k not in (*OWN, "fp16", "bf16")}
    ds.update(extra)
    if "deepspeed_extra_args" in cfg:
        notes.append(f"{spelled['deepspeed_extra_args']}: its keys are handed to DeepSpeed as they are (read above: "
                     f"{', '.join(extra) or 'none'})")
    if precision == "fp16":
        ds["fp16"] = _read(blocks["fp16"] or {"enabled": True}, "fp16", notes, source) | {"enabled": True}
    elif precision == "bfloat16":
        ds["bf16"] = _read(blocks["bf16"], "bf16", notes, source) if blocks["bf16"] else {"enabled": True}
        ds["bf16"]["enabled"] = True
    else:
        ds["fp16"] = {"enabled": False}
        for key in ("fp16", "bf16"):
            if key in cfg:
                notes.append(f"{key}: not enabled, so DeepSpeed does not read its other keys")
    if precision == "fp16" and blocks["bf16"]:
        notes.append("bf16: not enabled (precision fp16)")
    if precision == "bfloat16" and blocks["fp16"]:
        notes.append("fp16: not enabled (precision bfloat16)")
    ds.setdefault("zero_optimization", {"stage": 0})
    where = "precision" if "precision" in cfg else f"{'fp16' if precision == 'fp16' else 'bf16'}.enabled"
    if precision == "fp32":
        where = "precision"
    elif precision is None:  # only an amp block: DeepSpeed runs apex AMP with it
        where = "amp"
    fp16_ce = flag(source, "fp16_lm_cross_entropy", cfg.get("fp16_lm_cross_entropy", False))
    if fp16_ce and precision != "fp16":
        raise bad(source, "fp16_lm_cross_entropy", "true without precision fp16: NeoX refuses it ('lm cross entropy "
                                                   "in fp16 only support in fp16 mode', arguments.py validate_values)")
    softmax = flag(source, "attention_softmax_in_fp32", cfg.get("attention_softmax_in_fp32", False))
    scaling = flag(source, "apply_query_key_layer_scaling", cfg.get("apply_query_key_layer_scaling", False))
    for key, on in (("attention_softmax_in_fp32", softmax), ("apply_query_key_layer_scaling", scaling)):
        if key in cfg and not on:
            notes.append(f"{spelled[key]}: false (the attention softmax in the model dtype unless the other is set)")
    if flag(source, "fp32_allreduce", cfg.get("fp32_allreduce", False)):
        notes.append("fp32_allreduce: the tensor-parallel all-reduces run in float32 (megatron/mpu/mappings.py "
                     "_reduce); the data-parallel gradient reduce is DeepSpeed's (above), which DeeperSpeed does not "
                     "change for it (not held)")

    def model(d: Draft) -> None:
        if precision == "fp32":
            return
        from unimp.migrate.megatron import _move

        if not fp16_ce:
            _move(d, "loss", "float32", "fp16_lm_cross_entropy false (NeoX default): gpt2_model.py cross_entropy "
                                        "computes vocab_parallel_cross_entropy(output.float(), labels)")
        if softmax or scaling:
            key = "attention_softmax_in_fp32" if softmax else "apply_query_key_layer_scaling"
            _move(d, "softmax", "float32", f"{key}: FusedScaleMaskSoftmax(softmax_in_fp32=True) (transformer.py)")

    imp = deepspeed.import_policy(ds, source=source, model=model)
    whys: dict[str | None, str] = {
        "fp16": "precision fp16: the DeepSpeed fp16 block", "bfloat16": "precision bfloat16: DeepSpeed bf16",
        "fp32": "precision fp32: no DeepSpeed fp16/bf16", None: "precision not given: the DeepSpeed amp block"}
    why = whys[precision]
    return relabel(imp, SYSTEM, source, f"{why} ({where})", (), tuple(notes))


def _block(cfg: Mapping[str, Any], key: str, source: str) -> Mapping[str, Any]:
    block = cfg.get(key)
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise bad(source, key, f"expected a table (a DeepSpeed {key} block), got {show(block)}")
    return block


def _read(block: Mapping[str, Any], key: str, notes: list[str], source: str) -> dict[str, Any]:
    """The keys of a NeoX ``fp16`` / ``bf16`` block that DeepSpeed reads; the others noted with why."""
    known = deepspeed.FP16_KEYS if key == "fp16" else deepspeed.BF16_KEYS
    out = {}
    for k, v in block.items():
        if k in known:
            out[k] = v
        elif k in NOT_READ or key == "bf16":
            why = NOT_READ.get(k, "bf16 has no loss scaling (DeepSpeed reads enabled and its bf16 keys only)")
            notes.append(f"{key}.{k} = {v!r:.40}: not read ({why}); the run trains in "
                         f"{'float16' if key == 'fp16' else 'bfloat16'}")
            if k == "type" and v != key:  # fp16: {type: bfloat16} reads as bf16 to a person, not to DeepSpeed
                warnings.warn(f"{source}: {notes[-1]}", UnimpWarning, stacklevel=3)
        else:
            out[k] = v  # the DeepSpeed importer names it as an unknown key
    return out


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, str):
        raw = pasted_yaml(raw, source, "a NeoX YAML config (precision: \"bfloat16\", fp16: {...}, ...)")
    return import_policy(raw, source=source)


def export_policy(policy: Policy, into: Mapping[str, Any] | None = None) -> Exported:
    """NeoX YAML keys for the policy: ``precision``, the DeepSpeed block, ``zero_optimization`` when its
    loss scaler needs one, ``fp16_lm_cross_entropy`` / ``attention_softmax_in_fp32`` where the policy's
    loss / softmax categories say so. ``into``: the user's NeoX config, only these keys changed."""
    import yaml

    base = deepspeed.export_policy(policy)
    cfg: dict[str, Any] = {"precision": {"float16": "fp16", "bfloat16": "bfloat16"}.get(policy.compute_dtype, "fp32")}
    cfg.update({k: v for k, v in base.config.items() if not (k == "fp16" and v == {"enabled": False})})
    if policy.compute_dtype == "float16" and policy.ops.category("loss") == "lower":
        cfg["fp16_lm_cross_entropy"] = True
    if policy.compute_dtype != "float32" and policy.ops.category("softmax") == "float32":
        cfg["attention_softmax_in_fp32"] = True
    changed: tuple[str, ...] = ()
    notes = tuple(u for u in base.unexpressed if u.startswith("zero_optimization.stage"))
    if into is not None:
        src = {k.replace("-", "_"): v for k, v in into.items()}
        zero = cfg.pop("zero_optimization", None)
        cfg, changed = merge_into(into, cfg, OWNED)  # the file's own key spellings kept
        if zero is not None and int((src.get("zero_optimization") or {}).get("stage", 0)) == 0:
            cfg["zero_optimization"] = {**(src.get("zero_optimization") or {}), **zero}
            changed += ("zero_optimization.stage (set to 1)",)
        else:
            notes = ()
    text = yaml.safe_dump(cfg, sort_keys=False)
    out = finish(SYSTEM, policy, cfg, text, import_policy)
    return Exported(SYSTEM, cfg, text, out.unexpressed + notes, changed)
