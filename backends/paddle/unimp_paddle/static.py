"""The static-graph Amp: Paddle's legacy-IR bf16 rewrite with lists compiled from the policy.

Needs the legacy IR (``FLAGS_enable_pir_api=0`` before paddle is imported); under PIR, Paddle's
``rewrite_program_bf16`` refuses the Program. Runs bfloat16 on CPU (oneDNN flag off).

>>> import os; os.environ["FLAGS_enable_pir_api"] = "0"
>>> import paddle, unimp
>>> paddle.enable_static()
>>> main, start = paddle.static.Program(), paddle.static.Program()
>>> with paddle.static.program_guard(main, start):
...     x = paddle.static.data("x", [4, 16], "float32")
...     loss = paddle.mean(paddle.nn.Linear(16, 8)(x))
>>> amp = unimp.apply({"extends": "mixed_bf16", "on_unsupported": "fallback"}, main,
...                   paddle.optimizer.Adam(0.01))
>>> _ = amp.optimizer.minimize(loss, start)
>>> paddle.disable_static()
"""

from __future__ import annotations

import dataclasses
from typing import Any

from unimp.spi import Amp, LossScale, LossScaleState, Plan, Report, UnsupportedError

from . import trace
from .ops import canonical_of, op_types
from .optimizer import StaticAmpOptimizer

RANK2_ONLY = {"matmul_v2": "X", "layer_norm": "X"}  # bf16 CPU kernels that mis-read rank > 2 inputs


class PaddleStaticAmp(Amp):
    """A policy bound to a legacy-IR ``paddle.static.Program`` (rewritten in place; remove() undoes it)."""

    def __init__(self, plan: Plan, program: Any, optimizer: Any = None) -> None:
        import paddle

        if paddle.framework.in_pir_mode() or not hasattr(program, "global_block"):
            raise UnsupportedError("unimp.apply on a static Program needs the legacy IR: set "
                                   "FLAGS_enable_pir_api=0 before importing paddle")
        if optimizer is not None and not hasattr(optimizer, "minimize"):
            raise TypeError(f"unimp.apply: optimizer must be a paddle.optimizer.Optimizer, got "
                            f"{type(optimizer).__name__}")
        super().__init__(plan, program, optimizer)
        self._original = program.clone()
        self._state = LossScale(self._loss_scale_run()).initial_state()
        self.fp32_vars: dict[str, str] = {}
        self._training = optimizer is not None
        if plan.details.amp_active:
            self.amp_lists = self._amp_lists(program)
            from paddle.static.amp.bf16 import rewrite_program_bf16

            rewrite_program_bf16(program, self.amp_lists)
        else:
            self.amp_lists = None
        self.optimizer = StaticAmpOptimizer(optimizer, program) if optimizer is not None else None

    def _amp_lists(self, program: Any) -> Any:
        from paddle.static.amp.bf16 import AutoMixedPrecisionListsBF16

        lists = self.plan.details.lists
        fixed = {t for d in self.plan.ops if d.control == "fixed" and d.dtype == "float32"
                 for t in op_types(d.op)}
        white = set(lists.white) - fixed
        black = set(lists.black) | fixed
        self.fp32_vars = self._fp32_vars(program, white)
        out = AutoMixedPrecisionListsBF16(custom_bf16_list=white, custom_fp32_list=black,
                                          custom_fp32_varnames=set(self.fp32_vars) or None)
        gray = set(lists.gray) - black - white
        out.gray_list = (out.gray_list - black - white) | gray
        out.fp32_list -= gray
        return out

    def _fp32_vars(self, program: Any, white: set[str]) -> dict[str, str]:
        """Vars kept float32 by name: float32 overrides (by parameter-name prefix) and rank>2 ops."""
        block = program.global_block()
        out: dict[str, str] = {}
        for p in program.all_parameters():
            prefix = p.name.split(".")[0]  # the layer's name: the override's globs and types match it
            d = self.plan.decide(prefix, canonical_of(prefix))
            if d.sets_compute and d.compute_dtype == "float32":
                out[p.name] = f"overrides[{d.override}]"
        problems = []
        for op in block.ops:
            if op.type == "matmul_v2" and op.type in white and self._training:
                out.update({n: "matmul_v2 grad" for n in op.output_arg_names})
                problems.append(f"matmul_v2 (output {op.output_arg_names[0]}): Paddle's bf16 matmul_v2_grad "
                                f"segfaults on CPU (oneDNN); runs float32 in training (the mul op of "
                                f"paddle.static.nn.fc trains in bf16)")
                continue
            slot = RANK2_ONLY.get(op.type)
            if slot is None or op.type not in white:
                continue
            name = op.input(slot)[0]
            if len(block.var(name).shape) > 2:
                for out_name in op.output_arg_names:
                    out[out_name] = f"{op.type} rank>2"
                problems.append(f"{op.type} (input {name}, rank {len(block.var(name).shape)}): Paddle's "
                                f"bf16 CPU kernel mis-reads inputs of rank > 2; runs float32")
        if problems and self.plan.on_unsupported == "error":
            raise UnsupportedError("cannot run in bfloat16 on the static path:\n  " + "\n  ".join(problems)
                                   + "\nfix: reshape activations to 2-D / use paddle.static.nn.fc (mul), or set "
                                     "on_unsupported = \"fallback\"")
        self.findings += problems
        return out

    # ------------------------------------------------------------------ contract
    def _loss_scale_run(self) -> Any:
        return dataclasses.replace(self.plan.loss_scale, mode="none")  # no scaling in static Programs (Plan note)

    def loss_scale_state(self) -> LossScaleState:
        return self._state

    def set_loss_scale_state(self, state: LossScaleState) -> None:
        self._state = state

    def op_dtypes(self, executor: Any, feed: dict[str, Any], scope: Any = None) -> list[tuple[str, str, str]]:
        """Run the Program once: ``(op type, output var, dtype)`` per canonical op (:func:`trace.program_dtypes`)."""
        return trace.program_dtypes(self.model, executor, feed, scope)

    def report(self, executor: Any = None, feed: dict[str, Any] | None = None, scope: Any = None) -> Report:
        """Rows per canonical op of the Program, dtypes from a real run (``executor`` + ``feed``)."""
        rows = trace.program_rows(self.op_dtypes(executor, feed or {}, scope)) if executor is not None else []
        return self.report_header(rows, trace.report_notes(self.plan))

    def _start_watch(self, watch: Any) -> None:
        raise UnsupportedError(self._no_watch("amp.watch()"))

    def _tensorboard_writer(self, logdir: Any) -> Any:
        raise UnsupportedError(self._no_watch("amp.watch(tensorboard=...)"))

    @staticmethod
    def _no_watch(verb: str) -> str:
        return (f"{verb}: a static Program runs whole in the executor, with no per-layer hook and no Python step "
                f"to read a layer's output or gradient in (no loss scaling either: nothing is skipped); watch a "
                f"dygraph model (unimp.apply(policy, layer, optimizer)), or fetch the variables you want from "
                f"executor.run(fetch_list=...)")

    def _restore(self) -> None:
        from paddle.base import core
        from paddle.base.framework import Block

        program, orig = self.model, self._original
        program.desc = core.ProgramDesc(orig.desc)
        program.blocks = [Block(program, i) for i in range(program.desc.num_blocks())]
        program._sync_with_cpp()
        program._copy_param_info_from(orig)
