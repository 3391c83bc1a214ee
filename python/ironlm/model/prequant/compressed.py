"""compressed-tensors (what llm-compressor writes), per linear:

- `pack-quantized` (W4A16, W8A16, any 1..8 bits): `weight_packed` int32 `[out, in b / 32]` (a bit stream along the
  input dimension), `weight_shape`, `weight_scale` `[out, groups]` (`[out, 1]` per channel), asymmetric ones
  `weight_zero_point` packed along the output dimension, `weight_g_idx` for act-order groups. Values and zero
  points are signed, stored offset by `2^(b-1)`: the raw unsigned fields are the core's `q` and `z` directly.
- `int-quantized` / `naive-quantized` (W8A8, or unpacked low-bit): `weight` int8 `[out, in]`, scales as above.
  W8A8's activation scales (`input_scale`, static) are not used: on the CPU the core's int8 kernels quantize the
  activations per 32-block at run time, finer than one static per-tensor scale, so the result is nearer the
  float model than an int8 x int8 GEMM with the static scale (no clipping at it either).
- `float-quantized`: FP8 e4m3, see fp8.py.
"""

from __future__ import annotations

import numpy as np
import torch

from ironlm.model.prequant import fp8
from ironlm.model.prequant.bits import Unpacked, affine, unpack_bits
from ironlm.model.prequant.scheme import Scheme

LEAVES = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale",
          "input_zero_point")


def is_quantized_weight(tensor: torch.Tensor) -> bool:
    """A `weight` that is the quantized integers / floats themselves (int-, naive- and float-quantized)."""
    return tensor.dtype in (torch.int8, torch.float8_e4m3fn)


def unpack(name: str, t: dict[str, torch.Tensor], scheme: Scheme) -> Unpacked | torch.Tensor:
    if scheme.fmt == "float-quantized":
        return fp8.dense(name, t["weight"], t["weight_scale"])
    b, off = scheme.bits, 1 << (scheme.bits - 1)
    if "weight_packed" in t:
        out, cols = (int(v) for v in t["weight_shape"].tolist())
        q = unpack_bits(t["weight_packed"], b, cols)
    else:
        w = t["weight"]
        out, cols = w.shape
        q = (w.to(torch.int16) + off).to(torch.uint8).numpy()
    scale = t["weight_scale"].reshape(out, -1) if t["weight_scale"].numel() > 1 else \
        t["weight_scale"].reshape(1, 1).expand(out, 1)
    groups = scale.shape[1]
    zp = t.get("weight_zero_point")
    if scheme.sym or zp is None:
        zero = np.full((out, groups), off, dtype=np.int32)
    elif zp.dtype == torch.int32 and "weight_packed" in t:
        zero = unpack_bits(zp.t().contiguous(), b, out).T.astype(np.int32)  # packed along the output dim
    else:
        zero = zp.reshape(out, -1).to(torch.int32).numpy() + off
    g_idx = t.get("weight_g_idx")
    group = 0 if groups == 1 else cols // groups
    if g_idx is not None and bool((g_idx.to(torch.int64) == torch.arange(cols) // (group or cols)).all()):
        g_idx = None
    return affine(name, np.ascontiguousarray(q), scale, zero, scheme.container, g_idx=g_idx, group=group)
