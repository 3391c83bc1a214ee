"""Zero-copy numpy views of torch tensors for the core's CPU kernels (``ironlm._core``).

Neutral ground: the model package and the attention backends both hand tensors to the core, and neither
imports the other for it.
"""

from __future__ import annotations

import numpy as np
import torch

# Dtypes the core's CPU kernels read; half types cross to numpy as int16 views of their bits.
CORE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a CPU tensor for the core: float32 as is, 16-bit floats as int16 bits."""
    return t.numpy() if t.dtype == torch.float32 else t.view(torch.int16).numpy()


def core_ok(t: torch.Tensor) -> bool:
    """Whether the core's fused CPU kernels can take `t` (a dense row-major CPU float tensor)."""
    return t.device.type == "cpu" and t.dtype in CORE_DTYPES and t.is_contiguous()
