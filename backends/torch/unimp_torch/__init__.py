"""unimp backend for PyTorch (``pip install unimp-torch``).

>>> import torch, unimp
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
>>> amp = unimp.apply("mixed_bf16", model, torch.optim.AdamW(model.parameters()))
>>> amp.model(torch.randn(2, 8)).dtype
torch.float32
>>> _ = amp.remove()

Distributed: ``amp.ddp(...)`` (or ``unimp.apply(policy, DDP(model), opt)``) and, for FSDP2,
``unimp_torch.fully_shard(model, policy, units=...)`` then ``unimp.apply(policy, model, opt)``;
``unimp_torch.mixed_precision_policy(policy)`` is the compiled ``MixedPrecisionPolicy``.

Importing this package does not import torch; the modules that need it import it lazily.
"""

__all__ = ["TorchBackend", "fully_shard", "mixed_precision_policy", "reduce_hook", "ReduceState"]

_DISTRIBUTED = {"fully_shard", "mixed_precision_policy", "reduce_hook", "ReduceState"}


def __getattr__(name: str):
    if name == "TorchBackend":
        from .backend import TorchBackend

        return TorchBackend
    if name in _DISTRIBUTED:
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(name)
