"""The loss scale: unimp-torch's ``DeviceLossScale`` of the inner ``TorchAmp``, unchanged. IPEX's own bf16
master step cannot be unscaled or skipped, so a policy with loss scaling runs IPEX in float32 (``modes.py``)."""

from unimp_torch.extension import DeviceLossScale as DeviceLossScale
