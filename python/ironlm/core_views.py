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


def indexable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a view of its uint8 codes where it holds 8-bit floats: torch has no fp8 `index_copy_` on CPU, and
    copying the codes copies the values."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`, but 8-bit floats by bit arithmetic, as the core's vector loads read them: torch converts
    float8 elementwise in scalar code (~1.5 ns an element here, 20x its bf16 cast), what a prompt's K/V rounding
    through an 8-bit cache spent most of its time on. e4m3: sign-extended, the magnitude shifted under an f32's
    exponent (biased 120 below f32's; subnormals land on f32 subnormals) and scaled by 2^120, its NaN codes read as
    +-480 as the kernels read them; e5m2: the top byte of a half."""
    if t.dtype == torch.float8_e4m3fn:
        bits = (t.view(torch.int8).to(torch.int32) << 20) & _E4M3_BITS
        return (bits.view(torch.float32) * 2.0**120).to(dtype)
    if t.dtype == torch.float8_e5m2:
        return (t.view(torch.uint8).to(torch.int16) << 8).view(torch.float16).to(dtype)
    return t.to(dtype)


_E4M3_BITS = -0x7810_0000  # 0x87F00000 as an int32: the sign bit and the magnitude's 7 bits


def core_ok(t: torch.Tensor) -> bool:
    """Whether the core's fused CPU kernels can take `t` (a dense row-major CPU float tensor)."""
    return t.device.type == "cpu" and t.dtype in CORE_DTYPES and t.is_contiguous()
