"""Fine-tune a small GPT-2 (random init, synthetic text) with HF's Trainer under a unimp policy.

    pip install . ./backends/torch torch==2.13.0 transformers accelerate
    python examples/hf_trainer.py [POLICY]          # default: examples/team_policy.toml

``UnimpTrainer`` is ``transformers.Trainer`` plus ``policy=``: the policy sets the dtypes, the loss
is scaled before backward, gradients are unscaled before clipping, skipped steps do not advance
the LR schedule, and checkpoints carry the loss-scale state. Leave ``fp16``/``bf16`` off.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import transformers

from unimp_torch.integrations.hf import UnimpTrainer

POLICY = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("team_policy.toml"))


def main() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    # the extra "text" column is dropped by remove_unused_columns (it reads the model's forward signature)
    rows = [{"input_ids": torch.randint(0, 128, (32,)), "text": "synthetic"} for _ in range(64)]
    rows = [{**r, "labels": r["input_ids"]} for r in rows]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(out, max_steps=20, per_device_train_batch_size=8, learning_rate=1e-3,
                                              logging_steps=5, save_steps=10, report_to=[], use_cpu=True)
        trainer = UnimpTrainer(policy=POLICY, model=model, args=args, train_dataset=rows)
        trainer.train()
        print(trainer.amp.report())
        print(f"loss scale {trainer.amp.scale:g}, skipped steps {trainer.amp.skipped_steps}")
        print("checkpoints:", sorted(p.name for p in Path(out).glob("checkpoint-*")))


if __name__ == "__main__":
    main()
