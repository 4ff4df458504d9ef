"""HF Trainer (UnimpTrainer) and Lightning (UnimpPrecision) against their own mixed precision."""

import copy
import logging

import lightning as L
import pytest
import torch
import transformers
from tolerance import reference_tolerance

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


def leaf_layers(model):
    return sum(1 for m in model.modules() if next(m.children(), None) is None)


def float32_at(native, module, run):
    """``run(native)``'s loss and gradient norm in float32 with ``native`` holding ``module``'s
    weights now (the weights a step starts from): the same computation without any low precision."""
    params = dict(native.named_parameters())
    with torch.no_grad():
        for name, p in module.named_parameters():
            params[name].copy_(p)
    native.zero_grad()
    with torch.autocast("cpu", enabled=False):
        loss = run(native)
    loss.backward()
    return loss.item(), float(torch.nn.utils.get_total_norm([p.grad for p in native.parameters()]))


def within(got, want, layers):
    """Each step's loss and gradient norm vs float32's at the same weights and batch, relative,
    within u*sqrt(n) of float16 (tests_models/tolerance.py): n the layers for the forward, twice
    that for the gradient (forward and backward). Returns the max relative differences."""
    assert len(got) == len(want) > 0, (got, want)
    loss = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(got, want))
    grad = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(got, want))
    assert loss <= reference_tolerance("float16", layers), (got, want)
    assert grad <= reference_tolerance("float16", 2 * layers), (got, want)
    return loss, grad


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
    """Gradients reach the optimizer unscaled: each step's gradient norm (the Trainer's own log) and
    loss equal float32's at the weights that step starts from, on the batch the Trainer feeds, within
    float16's rounding (a scale left in would be off by 2**15 or more); the MLP computes in float16."""
    ours = hf_trainer(tmp_path / "a", "mixed_fp16")
    native, want, seen = copy.deepcopy(ours.model), [], set()

    def reference(module, args, kwargs):  # a pre-hook: runs before the policy's forward, outside it
        want.append(float32_at(native, module, lambda m: m(*args, **kwargs).loss))

    fc = ours.model.transformer.h[0].mlp.c_fc
    hooks = [ours.model.register_forward_pre_hook(reference, with_kwargs=True),
             fc.register_forward_hook(lambda m, a, out: seen.add(out.dtype))]
    ours.train()
    for h in hooks:
        h.remove()
    got = [(h["loss"], h["grad_norm"]) for h in ours.state.log_history if "loss" in h]
    within(got, want, leaf_layers(ours.model))
    assert ours.amp.scale >= 2.0 ** 15 and ours.amp.skipped_steps == 0 and seen == {torch.float16}


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


class Float32Reference(L.Callback):
    """Each step: float32's loss and gradient norm at the weights the step starts from, on its batch;
    the loss the step returned and the norm of the gradients the optimizer is about to use."""

    def __init__(self, native):
        self.native, self.want, self.got, self.seen = native, [], [], set()

    def on_train_batch_start(self, trainer, module, batch, i):
        x, y = batch
        self.want.append(float32_at(self.native, module, lambda m: torch.nn.functional.cross_entropy(m(x), y)))
        self.hook = module.net[0].register_forward_hook(lambda m, a, out: self.seen.add(out.dtype))

    def on_before_optimizer_step(self, trainer, module, optimizer):  # unscaled, not yet clipped
        self.norm = float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()]))

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        self.hook.remove()
        self.got.append((float(outputs["loss"]), self.norm))


def test_lightning_mixed_fp16_trains_like_fp32_and_skips():
    """Lightning has no fp16 AMP on CPU ("16-mixed" falls back to bf16): mixed_fp16 against float32 at
    the same weights, each step (loss and the unscaled gradient norm, within float16's rounding)."""
    ours = Net()
    reference = Float32Reference(copy.deepcopy(ours))
    fit(ours, plugins=[UnimpPrecision("mixed_fp16")], callbacks=[reference])
    within(reference.got, reference.want, leaf_layers(ours.net))
    assert reference.seen == {torch.float16}
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
