"""Device facts for tests (see conftest.py): tolerances that depend on where and in which dtype an engine runs."""

from __future__ import annotations

import torch


def logprob_atol(device: torch.device | str, dtype: torch.dtype | str) -> float:
    """Tolerance on a chosen token's logprob against an fp32 oracle. fp32 on CPU runs the oracle's own kernels;
    fp32 on CUDA reorders reductions (cuBLAS, the Triton kernels in IEEE fp32); bf16 keeps 8 mantissa bits, so
    its logprobs are only good to about 2^-8 of the logits' scale."""
    kind = torch.device(device).type
    name = str(dtype).removeprefix("torch.")
    if name in ("float32", "fp32", "float"):
        return 1e-4 if kind == "cpu" else 5e-4
    if name in ("bfloat16", "bf16", "float16", "fp16", "half"):
        return 5e-2
    raise ValueError(f"no tolerance for dtype {dtype!r}")
