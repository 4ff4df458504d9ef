"""Train a small MLP classifier with PyTorch Lightning under a unimp policy.

    pip install . ./backends/torch torch==2.13.0 lightning
    python examples/lightning_train.py [POLICY]     # default: examples/team_policy.toml

``Trainer(plugins=[UnimpPrecision(policy)])`` replaces Lightning's ``precision=...``: the policy
sets the dtypes and the loss scaling; the scale is saved in Lightning's checkpoints.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from unimp_torch.integrations.lightning import UnimpPrecision

POLICY = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("team_policy.toml"))


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                                       torch.nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])  # call self(x): the policy runs inside forward
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), 1e-3)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = (x[:, :10].argmax(-1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    plugin = UnimpPrecision(POLICY)
    trainer = L.Trainer(plugins=[plugin], max_epochs=3, accelerator="cpu", logger=False,
                        enable_checkpointing=False, gradient_clip_val=1.0)
    trainer.fit(Classifier(), data)
    print(plugin.amp.report())
    print(f"loss scale {plugin.amp.scale:g}, skipped steps {plugin.amp.skipped_steps}")


if __name__ == "__main__":
    main()
