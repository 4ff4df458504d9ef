"""unimp backend for PyTorch (``pip install unimp-torch``).

>>> import torch, unimp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
>>> amp.model(torch.randn(2, 8)).dtype
torch.float32
>>> _ = amp.remove()

Importing this package does not import torch; the modules that need it import it lazily.
"""

__all__ = ["TorchBackend"]


def __getattr__(name: str):
    if name == "TorchBackend":
        from .backend import TorchBackend

        return TorchBackend
    raise AttributeError(name)
