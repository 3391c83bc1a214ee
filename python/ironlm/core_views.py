"""Zero-copy numpy views of torch tensors for the core's CPU kernels (``ironlm._core``).

Neutral ground: the model package and the attention backends both hand tensors to the core, and neither
imports the other for it.
"""

from __future__ import annotations

import numpy as np
import torch

# Dtypes the core's CPU kernels read; half types cross to numpy as int16 views of their bits.
CORE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# A KV cache may also hold 8-bit floats (EngineConfig.kv_cache_dtype fp8*), crossing as uint8 codes.
CACHE_DTYPES = {**CORE_DTYPES, torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor for the core: float32 as is, 16-bit floats as int16 bits, 8-bit
    floats as uint8 codes."""
    if t.dtype == torch.float32:
        return t.numpy()
    return t.view(torch.uint8 if t.dtype in FP8_DTYPES else torch.int16).numpy()


def core_ok(t: torch.Tensor) -> bool:
    """Whether the core's fused CPU kernels can take `t` (a dense row-major CPU float tensor)."""
    return t.device.type == "cpu" and t.dtype in CORE_DTYPES and t.is_contiguous()
