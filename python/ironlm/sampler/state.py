"""Per-slot sampling state: each sequence's parameters, in arrays indexed by the slot the core gave it.

Scalar parameters live on the host in numpy: the per-batch "which stages does any row need" test is an OR over
S small ints with no device sync, and each stage gets its per-row parameters with one small host-to-device copy.
Token-id lists (logit_bias, the stop ids masked for min_tokens) live in padded device tables.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ironlm.exceptions import InvalidArgumentError
from ironlm.sampler.rng import mix_seed
from ironlm.sampling_params import SamplingParams

# Per-slot feature bits. A step ORs the bits of its rows and skips every stage nobody needs.
F_RANDOM = 1  # not greedy
F_TOP_K = 2
F_TOP_P = 4
F_MIN_P = 8
F_REP = 16
F_PRES = 32
F_FREQ = 64
F_PENALTY = F_REP | F_PRES | F_FREQ
F_BIAS = 128
F_MIN_TOKENS = 256  # has stop ids to mask on the rows the core bans (min_tokens not reached)
F_LOGPROBS = 512  # asks for top-N (N >= 1) logprobs
F_CHOSEN = 1024  # reports logprobs (`logprobs` set, 0 included): needs its chosen token's logprob


def _extend(arr: np.ndarray, extra: int, fill: int = 0) -> np.ndarray:
    return np.concatenate([arr, np.full(extra, fill, arr.dtype)])


class IdRows:
    """Per-slot token-id lists on the device (optionally with a value per id), padded to the widest list by
    repeating the row's first id: a no-op where the ids are masked, and biased by 0 where they carry values."""

    def __init__(self, device: torch.device, with_values: bool = False) -> None:
        self.device = device
        self.ids = torch.zeros(0, 1, dtype=torch.long, device=device)
        self.values = torch.zeros(0, 1, dtype=torch.float32, device=device) if with_values else None

    def grow(self, extra: int) -> None:
        self.ids = torch.cat([self.ids, self.ids.new_zeros(extra, self.ids.shape[1])])
        if self.values is not None:
            self.values = torch.cat([self.values, self.values.new_zeros(extra, self.values.shape[1])])

    def set(self, slot: int, ids: list[int], values: list[float] | None = None) -> None:
        extra = len(ids) - self.ids.shape[1]
        if extra > 0:
            self.ids = torch.cat([self.ids, self.ids[:, :1].expand(-1, extra)], dim=1)
            if self.values is not None:  # new columns of the other rows repeat their first id: value 0
                self.values = torch.cat([self.values, self.values.new_zeros(self.values.shape[0], extra)], dim=1)
        width = self.ids.shape[1]
        self.ids[slot] = torch.tensor(ids + [ids[0]] * (width - len(ids)), dtype=torch.long, device=self.device)
        if self.values is not None:
            vals = list(values or ())
            self.values[slot] = torch.tensor(vals + [0.0] * (width - len(vals)), device=self.device)


class SlotState:
    """Each live slot's sampling parameters. Slots grow on demand; a removed slot is reset by its next `add`."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int) -> None:
        self.vocab_size = vocab_size
        self.capacity = 0
        self.active = np.zeros(0, bool)
        self.flags = np.zeros(0, np.int64)
        self.inv_temp = np.zeros(0, np.float32)
        self.top_k = np.zeros(0, np.int64)  # 0 = off
        self.top_p = np.zeros(0, np.float64)
        self.min_p = np.zeros(0, np.float32)
        self.rep = np.zeros(0, np.float32)
        self.pres = np.zeros(0, np.float32)
        self.freq = np.zeros(0, np.float32)
        self.seed = np.zeros(0, np.uint64)  # mixed: the random stream's key
        self.nlogprobs = np.zeros(0, np.int64)
        self.pen_row = np.zeros(0, np.int64)  # row in the penalty pool, -1 = none
        self.ban = IdRows(device)  # stop ids, masked while the core says min_tokens is not reached
        self.bias = IdRows(device, with_values=True)
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        if extra <= 0:
            return
        self.active = _extend(self.active, extra)
        self.flags = _extend(self.flags, extra)
        self.inv_temp = _extend(self.inv_temp, extra)
        self.top_k = _extend(self.top_k, extra)
        self.top_p = _extend(self.top_p, extra)
        self.min_p = _extend(self.min_p, extra)
        self.rep = _extend(self.rep, extra)
        self.pres = _extend(self.pres, extra)
        self.freq = _extend(self.freq, extra)
        self.seed = _extend(self.seed, extra)
        self.nlogprobs = _extend(self.nlogprobs, extra)
        self.pen_row = _extend(self.pen_row, extra, -1)
        self.ban.grow(extra)
        self.bias.grow(extra)
        self.capacity = capacity

    def add(self, slot: int, params: SamplingParams, seed: int, stop_token_ids: Sequence[int]) -> int:
        """Store a new sequence's parameters; returns its feature bits (also kept in `flags`)."""
        if slot < 0:
            raise InvalidArgumentError(f"slot must be >= 0, got {slot}", param="slot")
        if slot >= self.capacity:
            self.grow(max(slot + 1, 2 * self.capacity))
        if self.active[slot]:
            raise ValueError(f"slot {slot} is already in use")
        V = self.vocab_size
        if params.logit_bias and max(params.logit_bias) >= V:
            raise InvalidArgumentError(
                f"logit_bias token ids must be < vocab size {V}, got {max(params.logit_bias)}", param="logit_bias")
        flags = 0
        if not params.greedy:
            flags |= F_RANDOM
            flags |= F_TOP_K if 0 < params.top_k < V else 0
            flags |= F_TOP_P if params.top_p < 1.0 else 0
            flags |= F_MIN_P if params.min_p > 0.0 else 0
        flags |= F_REP if params.repetition_penalty != 1.0 else 0
        flags |= F_PRES if params.presence_penalty != 0.0 else 0
        flags |= F_FREQ if params.frequency_penalty != 0.0 else 0
        flags |= F_LOGPROBS if params.logprobs else 0
        flags |= F_CHOSEN if params.logprobs is not None else 0
        self.inv_temp[slot] = 1.0 / params.temperature if flags & F_RANDOM else 1.0
        self.top_k[slot] = params.top_k if flags & F_TOP_K else 0
        self.top_p[slot] = params.top_p
        self.min_p[slot] = params.min_p
        self.rep[slot] = params.repetition_penalty
        self.pres[slot] = params.presence_penalty
        self.freq[slot] = params.frequency_penalty
        self.seed[slot] = mix_seed(seed)
        self.nlogprobs[slot] = params.logprobs or 0
        self.pen_row[slot] = -1
        if params.logit_bias:
            ids = list(params.logit_bias)
            self.bias.set(slot, ids, [params.logit_bias[t] for t in ids])
            flags |= F_BIAS
        # Only a sequence with min_tokens is ever banned: the others need no device row.
        banned = sorted({t for t in stop_token_ids if 0 <= t < V}) if params.min_tokens > 0 else []
        if banned:
            self.ban.set(slot, banned)
            flags |= F_MIN_TOKENS
        self.flags[slot] = flags
        self.active[slot] = True
        return flags

    def remove(self, slot: int) -> None:
        self.pen_row[slot] = -1
        self.flags[slot] = 0
        self.active[slot] = False

    def is_active(self, slot: int) -> bool:
        return 0 <= slot < self.capacity and bool(self.active[slot])
