"""Where a Paddle layer lives and what its dtypes are called (imports paddle only when asked).

>>> dtype_name("paddle.bfloat16")
'bfloat16'
"""

from __future__ import annotations

from typing import Any

DTYPES = {"paddle.float32": "float32", "paddle.bfloat16": "bfloat16", "paddle.float16": "float16",
          "paddle.float64": "float64", "paddle.int64": "int64", "paddle.int32": "int32"}


def dtype_name(dtype: Any) -> str:
    """``paddle.bfloat16`` -> ``"bfloat16"``."""
    return DTYPES.get(str(dtype), str(dtype).replace("paddle.", ""))


def model_place(model: Any) -> str:
    """``"gpu"`` when the layer's parameters (or Paddle's current device) are on a GPU, else ``"cpu"``."""
    import paddle

    for p in model.parameters():
        return "gpu" if p.place.is_gpu_place() else "cpu"
    return "gpu" if paddle.device.get_device().startswith("gpu") else "cpu"
