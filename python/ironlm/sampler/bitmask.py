"""Structured outputs in the sampler: the core's packed token bitmask applied to logits."""

from __future__ import annotations

import numpy as np
import torch

from ironlm import _core

# A batch-level flag only (never in SlotState.flags): some row of this step is grammar-constrained.
F_GRAMMAR = 1 << 20

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    s = _SHIFTS.get(device)
    if s is None:
        s = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return s


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] packed int32 -> [R, vocab_size] bool (bit t % 32 of word t // 32 is token t)."""
    r = bits.shape[0]
    unpacked = (bits.unsqueeze(-1) >> _shifts(bits.device)) & 1
    return unpacked.view(r, -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, rows: np.ndarray, bits: np.ndarray) -> None:
    """In place: on row `rows[i]` of `logits` [S, V], tokens not set in `bits[i]` become -inf."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    bits = np.ascontiguousarray(bits, dtype=np.int32)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        # The core's loop skips whole words at once: unpacking in torch costs ~40x more on CPU (64 x 49k).
        _core.apply_token_bitmask(logits.numpy(), rows, bits)
        return
    dev = logits.device
    r = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(dev)
    allowed = unpack_bitmask(torch.from_numpy(np.ascontiguousarray(bits, dtype=np.int32)).to(dev), logits.shape[1])
    logits[r] = logits[r].masked_fill_(~allowed, float("-inf"))
