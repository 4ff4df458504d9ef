"""Paddle: ``paddle.amp.auto_cast(level, custom_white_list, custom_black_list, dtype)`` +
``paddle.amp.GradScaler(...)``, or fleet's ``strategy.amp_configs``, both directions.

Defaults read from python/paddle/amp/auto_cast.py (level "O1", dtype "float16"),
python/paddle/amp/grad_scaler.py (GradScaler: init_loss_scaling 2**16, incr_ratio 2.0,
decr_ratio 0.5, incr_every_n_steps 2000, decr_every_n_nan_or_inf 1) and fleet's
distributed_strategy.proto (AMPConfig: init_loss_scaling 32768, incr_every_n_steps 1000,
decr_every_n_nan_or_inf 2, incr_ratio 2, decr_ratio 0.8; the static graph's
update_loss_scaling rule). A native op name in a custom list moves its canonical op
(``unimp ops``); a name unimp has no canonical op for is an error.

>>> imp = import_policy({"level": "O1", "custom_black_list": ["matmul_v2"]}, {"init_loss_scaling": 1024.0})
>>> imp.policy.ops.category("matmul"), imp.policy.loss_scale.initial
('float32', 1024.0)
>>> export_policy(imp.policy).config["auto_cast"]["custom_black_list"][:2]
['bmm', 'einsum']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..loading import load
from ..ops import CANONICAL_OPS, kind_of
from ..policy import Policy
from .common import (
    Draft,
    Exported,
    Imported,
    bad,
    check_keys,
    finish,
    flag,
    has_knob,
    kwargs_of,
    refuse,
    short,
    take,
)

SYSTEM = "paddle"
# Paddle's names per canonical op (lower case: op types as in paddle.amp's white/black lists; capitalised:
# layer classes), from python/paddle/amp/amp_lists.py and python/paddle/static/amp/bf16/amp_lists.py. The
# importer reads Paddle configs without Paddle or its backend installed; unimp-paddle declares this table.
PADDLE_NATIVE_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul", "matmul_v2", "mul", "einsum", "bmm", "fused_gemm_epilogue"),
    "linear": ("linear", "Linear"),
    "conv": ("conv2d", "conv3d", "conv2d_transpose", "depthwise_conv2d", "Conv1D", "Conv2D", "Conv3D",
        "Conv2DTranspose"),
    "attention": ("flash_attn", "scaled_dot_product_attention", "MultiHeadAttention"),
    "rnn": ("rnn", "lstm", "LSTM", "GRU", "SimpleRNN"),
    "embedding": ("lookup_table_v2", "embedding", "Embedding"),
    "softmax": ("softmax", "Softmax"),
    "log_softmax": ("log_softmax", "LogSoftmax"),
    "layer_norm": ("layer_norm", "LayerNorm"),
    "rms_norm": ("rms_norm", "RMSNorm"),
    "batch_norm": ("batch_norm", "sync_batch_norm", "BatchNorm", "BatchNorm1D", "BatchNorm2D", "BatchNorm3D"),
    "group_norm": ("group_norm", "instance_norm", "GroupNorm", "InstanceNorm2D"),
    "activation": ("relu", "gelu", "silu", "tanh", "sigmoid", "ReLU", "GELU", "Silu", "Tanh", "Sigmoid"),
    "transcendental": ("exp", "expm1", "log", "log10", "log2", "pow", "rsqrt", "reciprocal", "square", "acos",
        "asin", "sinh", "cosh", "atanh", "tan", "erfinv", "softplus"),
    "reduction": ("reduce_sum", "sum", "mean", "reduce_mean", "reduce_prod", "cumsum", "cumprod", "p_norm",
        "frobenius_norm", "dist", "renorm"),
    "loss": ("softmax_with_cross_entropy", "cross_entropy", "cross_entropy2",
        "sigmoid_cross_entropy_with_logits", "nll_loss", "huber_loss", "log_loss", "margin_cross_entropy",
        "c_softmax_with_cross_entropy", "mse_loss"),
    "elementwise": ("elementwise_add", "elementwise_sub", "elementwise_mul", "elementwise_div"),
    "concat": ("concat", "stack"),
}
AUTO_CAST_KEYS = ("enable", "custom_white_list", "custom_black_list", "level", "dtype", "use_promote")
SCALER_KEYS = ("enable", "init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps",
               "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling")
AMP_CONFIG_KEYS = ("init_loss_scaling", "incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_ratio", "decr_ratio",
                   "use_dynamic_loss_scaling", "custom_white_list", "custom_black_list", "custom_black_varnames",
                   "use_pure_fp16", "use_fp16_guard", "use_optimizer_fp16", "use_pure_bf16")
GRAD_SCALER = {"init_loss_scaling": 65536.0, "incr_ratio": 2.0, "decr_ratio": 0.5, "incr_every_n_steps": 2000,
               "decr_every_n_nan_or_inf": 1}
AMP_CONFIGS = {"init_loss_scaling": 32768.0, "incr_ratio": 2.0, "decr_ratio": 0.800000011920929,
               "incr_every_n_steps": 1000, "decr_every_n_nan_or_inf": 2}


def import_policy(auto_cast: Mapping[str, Any] | None = None, grad_scaler: Mapping[str, Any] | None = None, *,
                  source: str = "paddle") -> Imported:
    """The policy of ``with paddle.amp.auto_cast(**auto_cast)`` + ``paddle.amp.GradScaler(**grad_scaler)``
    (no GradScaler given: ``GradScaler()`` for float16, none for bfloat16)."""
    ac, gs = dict(auto_cast or {}), grad_scaler
    check_keys(ac, AUTO_CAST_KEYS, source, "auto_cast.")
    level = ac.get("level", "O1")
    dtype = ac.get("dtype", "float16")
    if level not in ("O0", "OD", "O1", "O2"):
        raise bad(source, "auto_cast.level", f"{short(level)} is not one of O0, OD, O1, O2")
    if dtype not in ("float16", "bfloat16"):
        raise bad(source, "auto_cast.dtype", f"{short(dtype)} is not float16 or bfloat16")
    if not flag(source, "auto_cast.enable", ac.get("enable", True)) or level == "O0":
        d = Draft(SYSTEM, source, "fp32", "auto_cast disabled (enable=False or level O0)")
        return d.build()
    if ac.get("use_promote", True) is not True:
        raise refuse(source, "auto_cast.use_promote", "False (run mixed-dtype ops in float32) has no policy key",
                     "remove it: unimp promotes the ops in ops.promote")
    d = Draft(SYSTEM, source, "paddle_o2" if level == "O2" else "paddle_o1", f"auto_cast level {level}")
    d.set("compute_dtype", dtype, "auto_cast.dtype" if "dtype" in ac else "auto_cast.dtype not given: float16")
    base = load(d.extends)
    lists = {"lower": list(base.ops.lower), "float32": list(base.ops.float32), "promote": list(base.ops.promote)}
    origin = f"{d.extends} lists"
    if level == "OD":
        lists = {"lower": lists["lower"], "float32": [o for o in CANONICAL_OPS if o not in lists["lower"]],
                 "promote": []}
        origin = "level OD: only the white list runs low"
    moves = _moves(ac, source, "auto_cast.")
    _apply(d, lists, moves, origin)
    if gs is None and dtype == "bfloat16":
        d.set("loss_scale.mode", "none", "no GradScaler given (bfloat16)")
        d.set("loss_scale.skip_nonfinite", False, "no GradScaler: every step is taken")
        return d.build()
    kw = dict(gs or {})
    check_keys(kw, SCALER_KEYS, source, "GradScaler.")
    _scaler(d, kw, GRAD_SCALER, "GradScaler." if gs is not None else "GradScaler() not given, defaults: ")
    return d.build()


def import_amp_configs(amp_configs: Mapping[str, Any], *, source: str = "paddle amp_configs") -> Imported:
    """The policy of fleet ``strategy.amp = True; strategy.amp_configs = amp_configs`` (static graph)."""
    cfg = dict(amp_configs)
    check_keys(cfg, AMP_CONFIG_KEYS, source, "amp_configs.")
    if cfg.get("custom_black_varnames"):
        raise refuse(source, "amp_configs.custom_black_varnames", "variables are named per program, not per op",
                     "move those layers to float32 with an [[overrides]] entry (modules = [...])")
    if cfg.get("use_optimizer_fp16"):
        raise refuse(source, "amp_configs.use_optimizer_fp16", "fp16 optimizer states have no policy key",
                     "remove it (unimp keeps optimizer state in float32)")
    bf16 = flag(source, "amp_configs.use_pure_bf16", cfg.get("use_pure_bf16", False))
    pure = flag(source, "amp_configs.use_pure_fp16", cfg.get("use_pure_fp16", False)) or bf16
    d = Draft(SYSTEM, source, "paddle_static_o1", "fleet amp (static graph update_loss_scaling rule)")
    if bf16:
        d.set("compute_dtype", "bfloat16", "amp_configs.use_pure_bf16")
    if pure:
        d.set("param_dtype", "bfloat16" if bf16 else "float16",
              "amp_configs.use_pure_bf16" if bf16 else "amp_configs.use_pure_fp16")
        d.set("master_weights.enabled", True, "pure AMP keeps float32 masters")
    base = load(d.extends)
    lists = {"lower": list(base.ops.lower), "float32": list(base.ops.float32), "promote": list(base.ops.promote)}
    _apply(d, lists, _moves(cfg, source, "amp_configs."), f"{d.extends} lists")
    _scaler(d, cfg, AMP_CONFIGS, "amp_configs.")
    return d.build()


def _moves(given: Mapping[str, Any], source: str, prefix: str) -> dict[str, tuple[str, str]]:
    """canonical op -> (list, source key) from custom_white_list / custom_black_list."""
    moves: dict[str, tuple[str, str]] = {}
    for key, target in (("custom_white_list", "lower"), ("custom_black_list", "float32")):
        names = given.get(key) or []
        if isinstance(names, str | bytes) or not isinstance(names, list | tuple | set | frozenset):
            raise bad(source, f"{prefix}{key}", "expected a list of op names")
        for i, name in enumerate(sorted(names) if isinstance(names, set | frozenset) else names):
            op = kind_of(name, PADDLE_NATIVE_OPS) if isinstance(name, str) else None
            where = f"{prefix}{key}[{i}]"
            if op is None:
                raise refuse(source, where, f"{short(name)} is not an op unimp controls (no canonical op has it)",
                             "remove it, or use one of the Paddle names `unimp ops` lists")
            if op in moves and moves[op][0] != target:
                raise bad(source, where, f"{short(name)} is also in {moves[op][1]} (canonical op {op}); keep one")
            moves[op] = (target, where)
    return moves


def _apply(d: Draft, lists: dict[str, list[str]], moves: dict[str, tuple[str, str]], origin: str) -> None:
    for op, (target, _) in moves.items():
        for name in lists:
            if op in lists[name]:
                lists[name].remove(op)
        lists[target].append(op)
    for name, ops in lists.items():
        why = [f"{op} <- {where}" for op, (t, where) in moves.items() if t == name]
        d.set(f"ops.{name}", ops, origin + (f" + {', '.join(why)}" if why else ""))


def _scaler(d: Draft, kw: dict[str, Any], defaults: Mapping[str, Any], prefix: str) -> None:
    if not flag(d.source, f"{prefix}enable", kw.get("enable", True)):
        d.set("loss_scale.mode", "none", f"{prefix}enable=False")
        d.set("loss_scale.skip_nonfinite", False, f"{prefix}enable=False: every step is taken")
        return
    dynamic = take(d, "loss_scale.mode", kw, "use_dynamic_loss_scaling", True, kind=bool, prefix=prefix,
                   convert=lambda on: "dynamic" if on else "static")
    take(d, "loss_scale.initial", kw, "init_loss_scaling", defaults["init_loss_scaling"], prefix=prefix)
    if dynamic == "static":
        return
    take(d, "loss_scale.growth_factor", kw, "incr_ratio", defaults["incr_ratio"], prefix=prefix)
    take(d, "loss_scale.backoff_factor", kw, "decr_ratio", defaults["decr_ratio"], prefix=prefix)
    take(d, "loss_scale.growth_interval", kw, "incr_every_n_steps", defaults["incr_every_n_steps"], kind=int,
         prefix=prefix)
    take(d, "loss_scale.hysteresis", kw, "decr_every_n_nan_or_inf", defaults["decr_every_n_nan_or_inf"], kind=int,
         prefix=prefix, minimum=1)
    if has_knob("loss_scale.factor_arithmetic"):
        d.set("loss_scale.factor_arithmetic", "float32", "Paddle multiplies in float32")


def from_cli(raw: Any, source: str) -> Imported:
    if isinstance(raw, Mapping) and "amp_configs" in raw:
        return import_amp_configs(raw["amp_configs"], source=source)
    roles = {"auto_cast", "amp_guard", "GradScaler"}
    if isinstance(raw, Mapping) and raw and not roles & set(raw) and not set(raw) <= set(AUTO_CAST_KEYS):
        return import_amp_configs(raw, source=source)  # a file holding fleet's amp_configs
    kw = kwargs_of(raw, source, {"auto_cast": "auto_cast", "amp_guard": "auto_cast", "GradScaler": "scaler",
                                 "amp_configs": "amp_configs"})
    if "amp_configs" in kw:
        return import_amp_configs(kw["amp_configs"], source=source)
    return import_policy(kw.get("auto_cast"), kw.get("scaler"), source=source)


def export_policy(policy: Policy) -> Exported:
    """``{"auto_cast": {...}, "GradScaler": {...}}``: custom lists hold the ops that differ from the
    level's defaults (their Paddle op types)."""
    level = "O2" if policy.param_dtype != "float32" else "O1"
    ac: dict[str, Any] = {"level": level, "dtype": policy.compute_dtype}
    if policy.compute_dtype == "float32":
        ac = {"enable": False}
    else:
        base = load("paddle_o2" if level == "O2" else "paddle_o1")
        white, black = [], []
        for op in CANONICAL_OPS:
            cat = policy.ops.category(op)
            if cat != base.ops.category(op) and cat in ("lower", "float32"):
                names = [n for n in PADDLE_NATIVE_OPS.get(op, ()) if n[:1].islower()]
                (white if cat == "lower" else black).extend(names)
        ac.update(custom_white_list=sorted(white), custom_black_list=sorted(black))
    ls = policy.loss_scale
    gs: dict[str, Any]
    if ls.mode == "none":
        gs = {"enable": False}
    else:
        gs = {"init_loss_scaling": ls.initial, "use_dynamic_loss_scaling": ls.mode == "dynamic"}
        if ls.mode == "dynamic":
            gs.update(incr_ratio=ls.growth_factor, decr_ratio=ls.backoff_factor, incr_every_n_steps=ls.growth_interval,
                      decr_every_n_nan_or_inf=ls.hysteresis)
    cfg = {"auto_cast": ac, "GradScaler": gs}
    text = (f"with paddle.amp.auto_cast({', '.join(f'{k}={v!r}' for k, v in ac.items())}):\n    ...\n"
            f"scaler = paddle.amp.GradScaler({', '.join(f'{k}={v!r}' for k, v in gs.items())})\n")
    return finish(SYSTEM, policy, cfg, text, lambda c: import_policy(c["auto_cast"], c["GradScaler"]))
