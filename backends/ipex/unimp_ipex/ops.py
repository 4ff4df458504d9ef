"""The native op names: unimp-torch's (IPEX runs torch's ops and CPU autocast lists; ``IpexBackend`` inherits them)."""

from unimp_torch.extension import TorchBackend

NATIVE_OPS = TorchBackend.native_ops
