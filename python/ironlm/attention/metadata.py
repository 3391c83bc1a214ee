"""Per-step attention metadata shared by every layer of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch


@dataclass
class AttentionMetadata:
    """Describes one step's token batch against the paged KV cache.

    Query rows of one sequence are contiguous; sequence ``i`` owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``. Token ``j`` of that chunk sits at absolute position
    ``context_lens[i] + j`` and attends to positions ``0 ..= context_lens[i] + j``.
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset; -1 = padding row, not written
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    context_lens: torch.Tensor  # [B] int32, tokens cached before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray  # host copies, so backends plan without device syncs
    seq_lens_cpu: np.ndarray
    # Backends memoise per-step plans here (index tensors, masks): built by the first layer, reused by the rest.
    plan_cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_numpy(
        cls,
        *,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        qsl = np.ascontiguousarray(query_start_loc, dtype=np.int32)
        sl = np.ascontiguousarray(seq_lens, dtype=np.int32)
        if max_query_len is None:
            max_query_len = int(np.diff(qsl).max(initial=0))
        if max_seq_len is None:
            max_seq_len = int(sl.max(initial=0))
        dev = torch.device(device)
        pin = dev.type == "cuda"

        def to_dev(a: np.ndarray, dtype: npt.DTypeLike) -> torch.Tensor:
            t = torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
            if pin:
                # Pinned source makes the H2D copy truly async: no sync on the step's critical path.
                return t.pin_memory().to(dev, non_blocking=True)
            return t.to(dev)

        bt = np.asarray(block_tables, dtype=np.int32)
        if bt.ndim == 1:
            bt = bt.reshape(len(sl), -1)
        return cls(
            slot_mapping=to_dev(slot_mapping, np.int64),
            query_start_loc=to_dev(qsl, np.int32),
            seq_lens=to_dev(sl, np.int32),
            context_lens=to_dev(context_lens, np.int32),
            block_tables=to_dev(bt, np.int32),
            max_query_len=int(max_query_len),
            max_seq_len=int(max_seq_len),
            query_start_loc_cpu=qsl.copy(),
            seq_lens_cpu=sl.copy(),
        )

    @classmethod
    def from_lengths(
        cls,
        *,
        context_lens: np.ndarray,
        query_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Derive slots and offsets from per-sequence lengths (tests, benches, warm-up passes)."""
        ctx = np.asarray(context_lens, dtype=np.int64)
        ql = np.asarray(query_lens, dtype=np.int64)
        bt = np.asarray(block_tables, dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(ql)])
        seq = np.repeat(np.arange(len(ql)), ql)
        pos = ctx[seq] + (np.arange(int(qsl[-1])) - qsl[:-1][seq])
        slots = bt[seq, pos // block_size] * block_size + pos % block_size
        return cls.from_numpy(
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=ctx + ql,
            context_lens=ctx,
            block_tables=bt,
            device=device,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)

    @property
    def context_lens_cpu(self) -> np.ndarray:
        return self.seq_lens_cpu - self.query_lens_cpu

    @property
    def decode_only(self) -> bool:
        """True when every sequence contributes exactly one query token."""
        return bool(self.max_query_len == 1 and self.num_seqs == int(self.query_start_loc_cpu[-1]))
