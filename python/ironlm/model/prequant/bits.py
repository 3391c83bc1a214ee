"""Unpacking int32-packed integers and mapping `w = s (q - z)` onto the core's 32-blocks.

Every format here packs its integers as one little-endian bit stream per row of int32 words: value `i` at bits
`[i b, i b + b)` (GPTQ's 3-bit words straddle values across words exactly so; compressed-tensors calls it dense
packing). AWQ only permutes the 8 nibbles of a word on top (see awq.py).

The core stores `w = scale * q + min` per 32 weights: `min = -s z`. With fp16 / bf16 scales `s z` (an 11-bit by at
most 9-bit product) and `s q + min` are exact in f32, so the matrix holds the checkpoint's weights bit for bit; an
f32 scale rounds `min` once to f32 (relative 2^-24, what any fp32 dequantization also does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ironlm import _core
from ironlm.exceptions import UnsupportedModelError

BLOCK = 32


def unpack_bits(words: torch.Tensor, bits: int, n: int) -> np.ndarray:
    """`words` int32 `[rows, w]` → uint8 `[rows, n]`, value `i` of a row at bits `[i b, i b + b)`."""
    raw = np.ascontiguousarray(words.to(torch.int32).numpy()).view("<u4").view(np.uint8)  # x86: little-endian
    rows = raw.shape[0]
    if bits == 8:
        return np.ascontiguousarray(raw[:, :n])
    if bits == 4:
        out = np.empty((rows, raw.shape[1] * 2), dtype=np.uint8)
        out[:, 0::2] = raw & 0xF
        out[:, 1::2] = raw >> 4
        return np.ascontiguousarray(out[:, :n])
    flat = np.unpackbits(raw, axis=1, bitorder="little")[:, : n * bits]
    return np.packbits(flat.reshape(rows, n, bits), axis=-1, bitorder="little").reshape(rows, n)


@dataclass
class Unpacked:
    """One linear's weights `[out, in]` as the core's blocks: `q` uint8 in the container's range, `scale` / `min`
    f32 `[out, in / 32]`; with `perm` (GPTQ act-order) stored column `j` is input column `perm[j]`."""

    q: np.ndarray
    scale: np.ndarray
    min: np.ndarray
    bits: int
    perm: torch.Tensor | None = None

    def matrix(self) -> _core.QuantMatrix:
        return _core.QuantMatrix.from_parts(self.q, self.scale, self.min, self.bits)

    def dense(self) -> torch.Tensor:
        """The exact f32 weights `[out, in]` in the checkpoint's column order."""
        w = np.repeat(self.scale, BLOCK, 1) * self.q + np.repeat(self.min, BLOCK, 1)
        t = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
        if self.perm is None:
            return t
        out = torch.empty_like(t)
        out[:, self.perm] = t
        return out

    def take_rows(self, idx: torch.Tensor) -> Unpacked:
        """Rows `idx` (output channels) in that order: lossless, rows are independent."""
        i = idx.numpy()
        return Unpacked(np.ascontiguousarray(self.q[i]), np.ascontiguousarray(self.scale[i]),
                        np.ascontiguousarray(self.min[i]), self.bits, self.perm)


def affine(name: str, q: np.ndarray, scale: torch.Tensor, zero: np.ndarray, container: int,
           g_idx: torch.Tensor | None = None, group: int = 0) -> Unpacked:
    """`w[o, i] = scale[o, g(i)] * (q[o, i] - zero[o, g(i)])`: `q` uint8 `[out, in]`, `scale` / `zero`
    `[out, groups]`; `g(i)` = `g_idx[i]` when given (GPTQ act-order: columns are sorted by group so each
    32-block has one, the permutation kept), else `i // group` (`group` 0 = one group)."""
    cols = q.shape[1]
    if cols % BLOCK:
        raise UnsupportedModelError(f"{name}: {cols} input columns, ironlm needs a multiple of {BLOCK}")
    perm = None
    if g_idx is not None:
        g = g_idx.to(torch.int64)
        if not bool((g[1:] >= g[:-1]).all()):
            perm = torch.argsort(g, stable=True)
            q = np.ascontiguousarray(q[:, perm.numpy()])
            g = g[perm]
        gcol = g.numpy()
    else:
        gcol = np.arange(cols) // (group or cols)
    blocks = gcol.reshape(-1, BLOCK)
    if not (blocks == blocks[:, :1]).all():
        raise UnsupportedModelError(f"{name}: a quantization group boundary falls inside a 32-weight block "
                                    "(g_idx / group_size): ironlm's blocks need groups of multiples of 32")
    gb = blocks[:, 0]
    s = scale.float().numpy()[:, gb]
    mins = -(s * zero.astype(np.float32)[:, gb])
    return Unpacked(q, np.ascontiguousarray(s, np.float32), np.ascontiguousarray(mins, np.float32), container, perm)
