"""GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 `[in b / 32, out]` packed along the input dimension (2/4/8 bits
whole values a word, 3 bits straddling words: one bit stream either way), `qzeros` int32 `[groups, out b / 32]`
along the output dimension, `scales` fp16 `[groups, out]`, `g_idx` int32 `[in]` (each input column's group:
`i // group` without act-order, a permutation of that with `desc_act`).

`w[o, i] = s[g, o] (q[i, o] - z[g, o])`, `g = g_idx[i]`. The original `gptq` checkpoint format stores `z - 1`
(AutoGPTQ's packer subtracts one, its kernels add it back); `gptq_v2` stores `z`."""

from __future__ import annotations

import numpy as np
import torch

from ironlm.model.prequant.bits import Unpacked, affine, unpack_bits
from ironlm.model.prequant.scheme import Scheme

LEAVES = ("qweight", "qzeros", "scales", "g_idx")


def unpack(name: str, t: dict[str, torch.Tensor], scheme: Scheme) -> Unpacked:
    b = scheme.bits
    scales = t["scales"]
    out = scales.shape[1]
    cols = t["qweight"].shape[0] * 32 // b
    q = unpack_bits(t["qweight"].t().contiguous(), b, cols)  # [out, in]
    zero = unpack_bits(t["qzeros"], b, out).T.astype(np.int32)  # [out, groups]
    if scheme.fmt == "gptq":
        zero = zero + 1
    g_idx = t.get("g_idx")
    group = scheme.group or cols
    if g_idx is not None and bool((g_idx.to(torch.int64) == torch.arange(cols) // group).all()):
        g_idx = None  # no act-order: the plain layout
    return affine(name, q, scales.t(), zero, scheme.container, g_idx=g_idx, group=scheme.group)
