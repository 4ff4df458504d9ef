"""Where a Paddle layer lives and what its dtypes are called (imports paddle only when asked).

>>> dtype_name("paddle.bfloat16")
'bfloat16'
"""

from __future__ import annotations

from typing import Any

from unimp.spi import dtype_name as core_dtype_name


def dtype_name(dtype: Any) -> str:
    """``paddle.bfloat16`` -> ``"bfloat16"`` (the core's one dtype-name normaliser)."""
    return core_dtype_name(dtype)


def model_place(model: Any) -> str:
    """``"gpu"`` when the layer's parameters (or Paddle's current device) are on a GPU, else ``"cpu"``."""
    import paddle

    for p in model.parameters():
        return "gpu" if p.place.is_gpu_place() else "cpu"
    return "gpu" if paddle.device.get_device().startswith("gpu") else "cpu"
