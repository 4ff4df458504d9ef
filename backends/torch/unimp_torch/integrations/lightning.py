"""PyTorch Lightning with a unimp policy: ``Trainer(plugins=[UnimpPrecision(policy)])``.

The plugin applies the policy when Lightning connects the model and its optimizer, scales the loss, unscales
the gradients before clipping, steps or skips through unimp's optimizer wrapper, and keeps the loss-scale state in
Lightning's checkpoints. The policy's rules run for the whole step (``forward_context``): call the model
(``self(x)``) in ``training_step``.

>>> import torch, lightning as L
>>> from unimp_torch.integrations.lightning import UnimpPrecision
>>> class Net(L.LightningModule):
...     def __init__(self):
...         super().__init__(); self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
...                                                            torch.nn.Linear(16, 2))
...     def forward(self, x): return self.net(x)
...     def training_step(self, batch, i): return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
...     def configure_optimizers(self): return torch.optim.SGD(self.parameters(), 0.1)
>>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8),
...                                    torch.randint(0, 2, (16,))), batch_size=4)
>>> plugin = UnimpPrecision("mixed_bf16")
>>> trainer = L.Trainer(plugins=[plugin], max_steps=3, accelerator="cpu", logger=False,
...                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
>>> trainer.fit(Net(), data)
>>> plugin.amp.report().row("net.0").compute_dtype
'bfloat16'
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision

from unimp.spi import apply, load


class UnimpPrecision(Precision):
    """A Lightning precision plugin running a unimp policy (a preset name, a file, a dict or a Policy)."""

    precision = "unimp"

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.unimp_policy = load(policy)
        self.amp: Any = None
        self._pending_state: dict[str, Any] | None = None

    def connect(self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]) -> Any:
        """Apply the policy to the LightningModule with every optimizer ``configure_optimizers`` returned (one
        loss scale; several: manual optimization, ``self.optimizers()``)."""
        self.amp = apply(self.unimp_policy, model, list(optimizers) or None)
        if self._pending_state is not None:
            self.amp.load_state_dict(self._pending_state)
            self._pending_state = None
        return model, list(self.amp.optimizers), lr_schedulers

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Each step (training/validation/test/predict) under the policy, as Lightning's MixedPrecision runs it
        under ``torch.autocast`` (lightning/pytorch/plugins/precision/amp.py, ``forward_context``)."""
        from ..forward import PolicyForward

        forward = vars(self.amp.model).get("forward") if self.amp is not None else None
        if not isinstance(forward, PolicyForward):
            yield
            return
        with forward.region(cache=False):  # as Lightning's autocast: optimizers may step inside (manual optimization)
            yield

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        return super().pre_backward(self.amp.scale_loss(tensor), module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        result = closure()  # training_step + backward of the scaled loss
        skip = result is None and getattr(model, "automatic_optimization", True)
        if not skip:  # gradient clipping and on_before_optimizer_step see true gradients (of this optimizer's params)
            self.amp.unscale_(optimizer if optimizer in self.amp.optimizers else None)
        self._after_closure(model, optimizer)
        if skip:
            return result
        return optimizer.step(**kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.amp.state_dict() if self.amp is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.amp is None:
            self._pending_state = dict(state_dict)  # restored when the model is connected
        else:
            self.amp.load_state_dict(state_dict)
