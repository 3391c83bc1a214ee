"""AWQ (AutoAWQ's GEMM layout): `qweight` int32 `[in, out / 8]` and `qzeros` int32 `[in / group, out / 8]`, 4-bit
along the output dimension with the nibbles of each word in AWQ's interleaved order (nibble k holds column
`8 j + [0, 2, 4, 6, 1, 3, 5, 7][k]`), `scales` fp16 `[in / group, out]`; `w = s (q - z)`, zero points as stored.

GEMV layout (`version: gemv`): `qweight` `[out, in / 8]` along the input dimension in plain nibble order, `qzeros`
`[out, width]` and `scales` `[out, 8 width]` along the groups, `width` padded (AutoAWQ's calculate_zeros_width): the
first `in / group` entries are the groups."""

from __future__ import annotations

import numpy as np
import torch

from ironlm.model.prequant.bits import Unpacked, affine, unpack_bits
from ironlm.model.prequant.scheme import Scheme

LEAVES = ("qweight", "qzeros", "scales")
# stored position of output column c within its word: the inverse of AWQ's pack order
_REVERSE = np.array([0, 4, 1, 5, 2, 6, 3, 7])


def _columns(words: torch.Tensor) -> np.ndarray:
    """`[r, n / 8]` AWQ words → `[r, n]` nibbles in output-column order."""
    v = unpack_bits(words, 4, words.shape[1] * 8)
    idx = (np.arange(v.shape[1]).reshape(-1, 8)[:, _REVERSE]).reshape(-1)
    return np.ascontiguousarray(v[:, idx])


def unpack(name: str, t: dict[str, torch.Tensor], scheme: Scheme) -> Unpacked:
    if scheme.fmt == "gemv":
        cols = t["qweight"].shape[1] * 8
        groups = cols // (scheme.group or cols)
        q = unpack_bits(t["qweight"], 4, cols)
        zero = unpack_bits(t["qzeros"], 4, t["qzeros"].shape[1] * 8)[:, :groups]
        return affine(name, q, t["scales"][:, :groups], zero, 4, group=scheme.group)
    q = _columns(t["qweight"]).T  # [out, in]
    zero = _columns(t["qzeros"]).T  # [out, groups]
    return affine(name, np.ascontiguousarray(q), t["scales"].t(), zero, 4, group=scheme.group)
