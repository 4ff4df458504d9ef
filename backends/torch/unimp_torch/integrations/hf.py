"""HF ``Trainer`` with a unimp policy: ``UnimpTrainer(policy=..., model=..., args=..., ...)``.

The policy is applied when the Trainer creates its optimizer. The loss is scaled before ``backward``; gradients
are unscaled (onto the fp32 masters) before clipping and the logged grad norm; a skipped step is reported to the
Trainer as skipped (the LR scheduler does not advance, as with ``fp16=True``; ``trainer.amp.skipped_steps``);
checkpoints carry the loss-scale state (``unimp_amp.pt``) and resuming restores it. Leave ``fp16``/``bf16`` in
``TrainingArguments`` off: the policy decides the dtypes.

>>> import torch, transformers
>>> from unimp_torch.integrations.hf import UnimpTrainer
>>> cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
>>> data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 4
>>> args = transformers.TrainingArguments("/tmp/unimp_hf_doctest", max_steps=2, per_device_train_batch_size=2,
...                                       report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
>>> trainer = UnimpTrainer(policy="mixed_bf16", model=transformers.GPT2LMHeadModel(cfg), args=args,
...                        train_dataset=data)
>>> trainer.remove_callback(transformers.PrinterCallback)
>>> _ = trainer.train(); trainer.amp.report().row("transformer.h.0.mlp.c_fc") is not None
True
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import torch
import transformers

from unimp.spi import Plan, apply, files, load

AMP_FILE = "unimp_amp.pt"


class _SkipReporter(transformers.TrainerCallback):
    """Tells the Trainer's (accelerate) optimizer whether unimp skipped the step just taken."""

    def __init__(self, trainer: UnimpTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        amp = self.trainer.amp
        skipped = amp is not None and amp.optimizer.last_skipped is not None and bool(amp.optimizer.last_skipped)
        if optimizer is not None and hasattr(optimizer, "_is_overflow"):
            optimizer._is_overflow = skipped  # read by accelerator.optimizer_step_was_skipped


class UnimpTrainer(transformers.Trainer):
    """``transformers.Trainer`` training under a unimp policy (a preset name, a file, a dict or a Policy)."""

    def __init__(self, *args: Any, policy: Any, **kwargs: Any) -> None:
        self.unimp_policy = load(policy)
        self.amp: Any = None
        targs = kwargs.get("args") or (args[1] if len(args) > 1 else None)
        if targs is not None and (targs.fp16 or targs.bf16):
            raise ValueError("UnimpTrainer: TrainingArguments(fp16=True / bf16=True) would run the Trainer's own "
                             "autocast on top of the unimp policy; fix: leave fp16/bf16 off (the "
                             f"{Plan.request(self.unimp_policy, 'torch').where} decides the dtypes and the loss "
                             "scaling)")
        super().__init__(*args, **kwargs)
        self.add_callback(_SkipReporter(self))

    # the optimizer is created right before training: apply the policy there
    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if self.amp is None:
            self.amp = apply(self.unimp_policy, self.model, optimizer)
            self.optimizer = self.amp.optimizer
        return self.optimizer

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """``compute_loss`` under the policy (where the Trainer's fp16/bf16 run it under
        Accelerate's autocast): a loss on the model's outputs runs the policy's rules."""
        from ..forward import PolicyForward

        forward = vars(self.amp.model).get("forward") if self.amp is not None else None
        return forward.region() if isinstance(forward, PolicyForward) else contextlib.nullcontext()

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        backward = self.accelerator.backward

        def scaled_backward(loss: torch.Tensor, **kwargs: Any) -> None:
            backward(loss if self.amp is None else self.amp.scale_loss(loss), **kwargs)

        self.accelerator.backward = scaled_backward

    def _clip_grad_norm(self, model: Any) -> Any:
        self.amp.unscale_()  # once per step; a no-op without loss scaling
        if self.amp.params.masters:  # the fp32 masters hold the gradients the optimizer uses
            return self.amp.clip_grad_norm_(self.args.max_grad_norm)
        return super()._clip_grad_norm(model)  # the Trainer's own clipping (same order, same norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            self.amp.unscale_()
            if self.amp.params.masters:
                grad_norm = self.amp.clip_grad_norm_(float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # checkpoints: the loss-scale state next to the optimizer's
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.amp is not None and self.args.should_save:
            buffer = io.BytesIO()  # then written whole or not at all (a full disk leaves no partial file)
            torch.save(self.amp.state_dict(), buffer)
            path = os.path.join(output_dir, AMP_FILE)
            files.write_file(path, buffer.getvalue(), where=f"checkpoint {files.shown(path)}")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, AMP_FILE) if checkpoint else None
        if path and os.path.isfile(path) and self.amp is not None:
            self.amp.load_state_dict(torch.load(path, weights_only=True))
