"""The immutable, framework-free precision policy.

>>> import unimp
>>> p = unimp.load("mixed_bf16")
>>> p.compute_dtype, p.ops.category("softmax")
('bfloat16', 'float32')
>>> p.replace(compute_dtype="float16").compute_dtype
'float16'
"""

from unimp.policy.resolved import LayerDecision, Policy
from unimp.policy.tables import Distributed, Fp8Spec, Layout, LossScaleSpec, MasterWeights, OpLists, Override

__all__ = ["Distributed", "Fp8Spec", "LayerDecision", "Layout", "LossScaleSpec", "MasterWeights", "OpLists",
           "Override", "Policy"]
