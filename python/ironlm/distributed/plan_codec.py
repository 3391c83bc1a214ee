"""The step plan's arrays packed into one int64 buffer, so that rank 0 hands a step to the workers in ONE broadcast.

Layout: a header of `HEADER` int64 (op, total length, array lengths, max query / seq length), then input_ids,
positions, slot_mapping, logits_indices, query_start_loc, seq_lens, context_lens, block_tables (row-major), the
copy-on-write pairs and the KV tier copies (demote, then promote pairs: every rank copies its own shard's rows). The broadcast buffer has a fixed capacity (`CAPACITY`, 64 KiB: every decode step of 256
sequences with short contexts fits); a larger plan sends its remainder in a second broadcast of exactly that size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ironlm import _core

OP_STOP, OP_STEP, OP_PROFILE = 0, 1, 2
HEADER = 12
CAPACITY = 8192  # int64 elements of the first broadcast


def no_pairs() -> np.ndarray:
    return np.zeros((0, 2), dtype=np.int64)


@dataclass
class StepArrays:
    """What the forward needs of a plan (the rest of it — sampling, requests — stays on rank 0)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray  # int32 [B, M]
    cow_pairs: np.ndarray  # [K, 2]
    max_query_len: int
    max_seq_len: int
    kv_demote: np.ndarray = field(default_factory=no_pairs)  # [D, 2] (device block, tier slot)
    kv_promote: np.ndarray = field(default_factory=no_pairs)  # [P, 2] (tier slot, device block)

    @classmethod
    def of(cls, plan: _core.SchedulerPlan) -> StepArrays:
        return cls(plan.input_ids, plan.positions, plan.slot_mapping, plan.logits_indices, plan.query_start_loc,
                   plan.seq_lens, plan.context_lens, plan.block_tables, plan.cow_pairs, int(plan.max_query_len),
                   int(plan.max_seq_len), plan.kv_demote, plan.kv_promote)


def pack(op: int, arrays: StepArrays | None = None, arg: int = 0) -> np.ndarray:
    """One int64 vector: header + arrays (`arg`: the token count of an OP_PROFILE)."""
    header = np.zeros(HEADER, dtype=np.int64)
    header[0] = op
    if arrays is None:
        header[1], header[2] = HEADER, arg
        return header
    a = arrays
    b, m = a.block_tables.shape if a.block_tables.ndim == 2 else (len(a.seq_lens), 0)
    k, d, p = len(a.cow_pairs), len(a.kv_demote), len(a.kv_promote)
    parts = [a.input_ids, a.positions, a.slot_mapping, a.logits_indices, a.query_start_loc, a.seq_lens,
             a.context_lens, a.block_tables.reshape(-1), np.asarray(a.cow_pairs).reshape(-1),
             np.asarray(a.kv_demote).reshape(-1), np.asarray(a.kv_promote).reshape(-1)]
    header[2:] = (len(a.input_ids), len(a.logits_indices), b, m, k, a.max_query_len, a.max_seq_len, d, p, 0)
    header[1] = HEADER + sum(p.size for p in parts)
    return np.concatenate([header] + [np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])


def unpack(data: np.ndarray) -> tuple[int, StepArrays | None, int]:
    """(op, arrays or None, arg) from a packed vector (at least the header's total length)."""
    op = int(data[0])
    if op != OP_STEP:
        return op, None, int(data[2])
    t, s, b, m, k, max_q, max_s, d, p = (int(x) for x in data[2:11])
    sizes = [t, t, t, s, b + 1, b, b, b * m, 2 * k, 2 * d, 2 * p]
    out = []
    at = HEADER
    for n in sizes:
        out.append(data[at:at + n])
        at += n
    ids, pos, slots, logit_rows, qsl, seq_lens, ctx_lens, bt, cow, demote, promote = out
    arrays = StepArrays(ids, pos, slots, logit_rows, qsl, seq_lens, ctx_lens,
                        bt.astype(np.int32).reshape(b, m), cow.reshape(k, 2), max_q, max_s,
                        demote.reshape(d, 2), promote.reshape(p, 2))
    return op, arrays, 0


class PlanChannel:
    """Both ends of the plan broadcast: rank 0 `send`s, the workers `receive`."""

    def __init__(self, broadcast: Callable[[torch.Tensor], None]) -> None:
        self._broadcast = broadcast
        self._buf = torch.zeros(CAPACITY, dtype=torch.int64)

    def send(self, packed: np.ndarray) -> None:
        n = len(packed)
        head = min(n, CAPACITY)
        self._buf.numpy()[:head] = packed[:head]
        self._broadcast(self._buf)
        if n > CAPACITY:
            self._broadcast(torch.from_numpy(np.ascontiguousarray(packed[CAPACITY:])))

    def receive(self) -> np.ndarray:
        self._broadcast(self._buf)
        first = self._buf.numpy()
        n = int(first[1])
        if n <= CAPACITY:
            return first[:n].copy()
        rest = torch.empty(n - CAPACITY, dtype=torch.int64)
        self._broadcast(rest)
        return np.concatenate([first, rest.numpy()])
