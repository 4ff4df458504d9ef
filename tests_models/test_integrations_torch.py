"""HF Trainer (UnimpTrainer) and Lightning (UnimpPrecision) against their own mixed precision."""

import copy
import logging

import lightning as L
import pytest
import torch
import transformers

from unimp_torch.integrations.hf import AMP_FILE, UnimpTrainer
from unimp_torch.integrations.lightning import UnimpPrecision

transformers.logging.set_verbosity_error()
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
G = torch.Generator().manual_seed(0)
ROWS = [{"input_ids": torch.randint(0, 64, (12,), generator=G), "extra": "not a model input"} for _ in range(16)]
OVERFLOW = {"name": "fp16_overflowing", "extends": "mixed_fp16", "loss_scale": {"initial": 2.0 ** 24}}


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def collate(rows):
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids}


def hf_trainer(tmp_path, policy=None, steps=6, **kw):
    kw = {"save_strategy": "no", **kw}
    args = transformers.TrainingArguments(str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                                          learning_rate=1e-3, lr_scheduler_type="linear", report_to=[],
                                          use_cpu=True, disable_tqdm=True, logging_steps=1,
                                          data_seed=0, seed=0, **kw)
    common = {"model": gpt2(), "args": args, "train_dataset": ROWS, "data_collator": collate}
    trainer = UnimpTrainer(policy=policy, **common) if policy is not None else transformers.Trainer(**common)
    trainer.remove_callback(transformers.PrinterCallback)
    return trainer


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_trainer_torch_autocast_cpu_equals_trainer_bf16(tmp_path):
    """remove_unused_columns (default) keeps input_ids; the run equals Trainer(bf16=True) bit for bit."""
    ours = hf_trainer(tmp_path / "a", "torch_autocast_cpu")
    ours.train()
    native = hf_trainer(tmp_path / "b", bf16=True)
    native.train()
    a, b = params(ours.model), params(native.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [h["loss"] for h in ours.state.log_history if "loss" in h] == \
        [h["loss"] for h in native.state.log_history if "loss" in h]


def test_hf_trainer_custom_loss_on_unchanged_outputs_equals_trainer_bf16(tmp_path):
    """A ``compute_loss_func`` on the logits: Trainer(bf16=True) gets them cast to float32 by Accelerate
    (``convert_outputs_to_fp32``); torch_autocast_cpu leaves them bf16 (as torch.autocast) and runs compute_loss
    under the policy, where the loss is float32: the same run, bit for bit."""
    seen = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(outputs.logits.dtype)
        logits = outputs.logits[:, :-1].flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].flatten())

    runs = []
    for policy, kw in (("torch_autocast_cpu", {}), (None, {"bf16": True})):
        trainer = hf_trainer(tmp_path / str(policy), policy, steps=3, **kw)
        trainer.compute_loss_func = loss_func
        trainer.train()
        runs.append(params(trainer.model))
    assert seen == [torch.bfloat16] * 3 + [torch.float32] * 3
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_hf_trainer_mixed_fp16_scales_the_loss(tmp_path):
    """Gradients reach the optimizer unscaled: mixed_fp16 trains like fp32 (not 65,536 times slower)."""
    ours = hf_trainer(tmp_path / "a", "mixed_fp16")
    ours.train()
    ref = hf_trainer(tmp_path / "b")
    start = params(ref.model)
    ref.train()
    a, b = params(ours.model), params(ref.model)
    moved = sum((b[k] - start[k]).abs().sum() for k in b)
    diff = sum((a[k] - b[k]).abs().sum() for k in b)
    assert ours.amp.scale >= 2.0 ** 15 and ours.amp.skipped_steps == 0
    assert diff < 0.05 * moved, (float(diff), float(moved))


def test_hf_trainer_skipped_steps_hold_the_scheduler_and_checkpoint_the_scale(tmp_path):
    trainer = hf_trainer(tmp_path, OVERFLOW, steps=6, save_strategy="steps", save_steps=6)
    trainer.train()
    skipped = trainer.amp.skipped_steps
    assert skipped > 0
    assert trainer.lr_scheduler.last_epoch == 6 - skipped  # the LR schedule advanced on applied steps only
    saved = torch.load(tmp_path / "checkpoint-6" / AMP_FILE, weights_only=True)
    assert saved == trainer.amp.state_dict()
    resumed = hf_trainer(tmp_path, OVERFLOW, steps=7)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    assert resumed.amp.state_dict()["steps"] == saved["steps"] + 1


def test_hf_trainer_refuses_its_own_autocast_on_top():
    args = transformers.TrainingArguments("/tmp/unimp_hf_refuse", bf16=True, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="leave fp16/bf16 off"):
        UnimpTrainer(policy="mixed_bf16", model=gpt2(), args=args, train_dataset=ROWS)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), 1e-2)


def fit(module, steps=8, **kw):
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)),
                                          torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(2)))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0, **kw)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return trainer


def test_lightning_torch_autocast_cpu_equals_bf16_mixed():
    ours, native = Net(), Net()
    fit(ours, plugins=[UnimpPrecision("torch_autocast_cpu")])
    fit(native, precision="bf16-mixed")
    a, b = params(ours), params(native)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lightning_mixed_fp16_trains_like_fp32_and_skips():
    """Lightning has no fp16 AMP on CPU ("16-mixed" falls back to bf16): mixed_fp16 against 32-true."""
    ours, native, start = Net(), Net(), params(Net())
    plugin = UnimpPrecision("mixed_fp16")
    fit(ours, plugins=[plugin])
    fit(native, precision="32-true")
    a, b = params(ours), params(native)
    moved = sum((b[k] - start[k]).abs().sum() for k in b)
    assert sum((a[k] - b[k]).abs().sum() for k in b) < 0.02 * moved
    overflow = UnimpPrecision(OVERFLOW)
    net = Net()
    trainer = fit(net, steps=4, plugins=[overflow])
    assert overflow.amp.skipped_steps > 0 and overflow.amp.scale < 2.0 ** 24
    assert overflow.state_dict() == overflow.amp.state_dict() and trainer.global_step == 4
    restored = UnimpPrecision(OVERFLOW)
    restored.load_state_dict(copy.deepcopy(overflow.state_dict()))
    again = Net()
    restored.connect(again, [torch.optim.SGD(again.parameters(), 0.1)], [])
    assert restored.amp.state_dict()["scale"] == overflow.amp.state_dict()["scale"]
