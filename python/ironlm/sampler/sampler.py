"""`Sampler.sample`: one call per step, a handful of gathers and whole-batch tensor ops.

Stop decisions are the core's: it tells each step which rows may not sample their stop tokens yet (min_tokens)
and how many tokens each row's sequence has generated (the random-stream position), so the sampler keeps no
per-sequence counter of its own. Slots in one `sample` call must be distinct.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ironlm.exceptions import InvalidArgumentError
from ironlm.sampler.bitmask import F_GRAMMAR, apply_token_bitmask
from ironlm.sampler.filters import TokenDraw
from ironlm.sampler.penalties import SeenTokens, penalize
from ironlm.sampler.rejection import DRAFT_ATTEMPT, Drafts, distribution, draw, verify
from ironlm.sampler.scratch import Scratch
from ironlm.sampler.state import (
    F_BIAS,
    F_CHOSEN,
    F_LOGPROBS,
    F_MIN_TOKENS,
    F_PENALTY,
    F_RANDOM,
    F_REP,
    SlotState,
)
from ironlm.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: np.ndarray  # [S] int64
    # [S] float32, chosen token under the raw (unprocessed) model distribution; NaN where no row of the step
    # reports logprobs (the log-sum-exp over the vocabulary is then skipped: it is a greedy step's largest cost
    # after the argmax at a 262k vocabulary)
    logprobs: np.ndarray
    top_ids: np.ndarray | None = None  # [S, K] int64, K = largest `logprobs` asked for in the batch
    top_logprobs: np.ndarray | None = None  # [S, K] float32, sorted descending


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, *, max_slots: int, seed: int) -> None:
        """`max_slots` (initial slot capacity, it grows) and `seed` come from EngineConfig, their one home."""
        if vocab_size <= 0:
            raise InvalidArgumentError(f"vocab_size must be > 0, got {vocab_size}", param="vocab_size")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._rng = np.random.default_rng(seed)
        self.state = SlotState(vocab_size, self.device, max(1, max_slots))
        self._seen = SeenTokens(vocab_size, self.device)
        self._scratch = Scratch(self.device)
        self._draw = TokenDraw(vocab_size, self.device, self.state, self._scratch)

    # -- slot lifecycle (Python loops are fine here: once per sequence) ----------------------------------

    def add(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int], seed: int | None = None,
            *, stop_token_ids: Sequence[int] = ()) -> None:
        """Start tracking a sequence. `stop_token_ids` are the ids the core stops it on (its
        `Scheduler.stop_token_ids(slot)`): masked on the rows `sample` is told to ban."""
        if seed is None:
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        flags = self.state.add(slot, params, seed, stop_token_ids)
        if flags & F_PENALTY:
            row = self._seen.alloc()
            self.state.pen_row[slot] = row
            if flags & F_REP:  # only repetition looks at the prompt
                self._seen.add_prompt(row, prompt_token_ids)

    def remove(self, slot: int) -> None:
        st = self.state
        if not st.is_active(slot):
            return
        if st.pen_row[slot] >= 0:
            self._seen.release(int(st.pen_row[slot]))
        st.remove(slot)

    # -- the hot path -------------------------------------------------------------------------------

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, slots: np.ndarray, output_lens: np.ndarray,
               ban_stop: np.ndarray | None = None,
               token_bitmask: tuple[np.ndarray, np.ndarray] | None = None,
               drafts: Drafts | None = None) -> SamplerOutput:
        """One token per row of `logits` [S, V]. Row i belongs to `slots[i]`, whose sequence has generated
        `output_lens[i]` tokens so far; where `ban_stop[i]`, its stop tokens are masked (the plan's
        `sample_slots`, `sample_output_lens` and `sample_ban_stop`). `token_bitmask` = (rows, bits), the core's
        `Scheduler.take_bitmask()`: on row `rows[i]` only the tokens set in `bits[i]` (packed int32, bit t % 32 of
        word t // 32) may be sampled. Masks and bans apply before temperature / top-k / top-p; logprobs stay
        those of the raw model distribution. `drafts`: a draft model's proposals (`propose`); their random rows
        are verified by modified rejection sampling (rejection.py), greedy rows stay the argmax."""
        slots = np.asarray(slots, dtype=np.int64)
        positions = np.asarray(output_lens, dtype=np.int64)
        S, V = logits.shape
        if S != len(slots) or S != len(positions):
            raise ValueError(f"logits has {S} rows but {len(slots)} slots and {len(positions)} output_lens")
        if V != self.vocab_size:
            raise ValueError(f"logits has {V} columns, sampler vocab_size is {self.vocab_size}")
        if S == 0:
            return SamplerOutput(np.zeros(0, np.int64), np.zeros(0, np.float32))
        if logits.dtype != torch.float32:
            logits = logits.float()
        st = self.state
        flags = st.flags[slots]
        # F_MIN_TOKENS marks rows that have stop ids to mask; only the core's ban makes them masked now.
        if ban_stop is None:
            flags = flags & ~F_MIN_TOKENS
        else:
            ban = np.asarray(ban_stop, dtype=bool)
            if ban.shape != (S,):
                raise ValueError(f"ban_stop has shape {ban.shape}, expected ({S},)")
            flags = np.where(ban, flags, flags & ~F_MIN_TOKENS)
        batch = int(np.bitwise_or.reduce(flags))
        dev = self.device
        if token_bitmask is not None and len(token_bitmask[0]):
            batch |= F_GRAMMAR
        else:
            token_bitmask = None

        top_ids = top_lp = None
        want_lp = bool(batch & (F_CHOSEN | F_LOGPROBS))
        if not batch & (F_RANDOM | F_PENALTY | F_BIAS | F_MIN_TOKENS | F_GRAMMAR):
            # Plain greedy: one max gives the token and the normaliser's shift; the argmax's logit is the max.
            raw_max, tokens = _row_max(logits)
            lse = self._logsumexp(logits, raw_max[:, None]) if want_lp else None
            chosen = None if lse is None else raw_max - lse
        else:
            raw_max = logits.amax(dim=-1, keepdim=True)
            lse = self._logsumexp(logits, raw_max) if want_lp else None
            proc = self._process(logits, slots, flags, batch, token_bitmask)
            tokens = torch.empty(S, dtype=torch.long, device=dev)
            rnd = (flags & F_RANDOM) != 0
            if not batch & F_RANDOM:
                tokens = proc.max(dim=-1).indices
            else:
                greedy = np.flatnonzero(~rnd)
                if len(greedy):
                    g = torch.from_numpy(greedy).to(dev)
                    tokens[g] = proc[g].max(dim=-1).indices
                # Without processing, the rows' max is the raw max already computed.
                self._draw.random_rows(proc, tokens, np.flatnonzero(rnd), slots, positions,
                                       raw_max if proc is logits else None)
                if drafts is not None and drafts.probs is not None:
                    rows = drafts.rows[drafts.random]
                    r, sl = torch.from_numpy(rows).to(dev), slots[rows]
                    p = distribution(proc[r], st, sl)
                    proposed = torch.from_numpy(drafts.tokens[drafts.random]).to(dev)
                    tokens[r] = verify(self._draw, p, drafts.probs, proposed, st.seed[sl], positions[rows])
            chosen = None if lse is None else logits.gather(1, tokens[:, None]).squeeze(1) - lse
        if batch & F_LOGPROBS:
            assert lse is not None
            k = min(int(st.nlogprobs[slots].max()), V)
            vals, top = self._draw.topk(logits, k)
            top_ids, top_lp = top.cpu().numpy(), (vals - lse[:, None]).cpu().numpy()
        token_ids = tokens.cpu().numpy()
        if batch & F_PENALTY:
            pen = np.flatnonzero(flags & F_PENALTY)
            self._seen.record(st.pen_row[slots[pen]], token_ids[pen])
        logprobs = np.full(S, np.nan, np.float32) if chosen is None else chosen.cpu().numpy()
        return SamplerOutput(token_ids, logprobs, top_ids, top_lp)

    @torch.inference_mode()
    def propose(self, logits: torch.Tensor, slots: np.ndarray, output_lens: np.ndarray,
                ban_stop: np.ndarray, token_bitmask: tuple[np.ndarray, np.ndarray] | None = None,
                ) -> tuple[np.ndarray, np.ndarray, torch.Tensor | None]:
        """A draft model's next token per row of its `logits` [S, V] (same slots, positions and bans as the
        target rows that will verify them): greedy rows take the argmax, random rows a draw from the filtered
        draft distribution q (under the rows' grammar masks, `Scheduler.draft_masks`, as `sample`'s).
        Returns (tokens, random rows mask, q of the random rows or None)."""
        slots = np.asarray(slots, dtype=np.int64)
        positions = np.asarray(output_lens, dtype=np.int64)
        if logits.dtype != torch.float32:
            logits = logits.float()
        st = self.state
        ban = np.asarray(ban_stop, dtype=bool)
        flags = np.where(ban, st.flags[slots], st.flags[slots] & ~F_MIN_TOKENS)
        batch = int(np.bitwise_or.reduce(flags)) | (F_GRAMMAR if token_bitmask is not None else 0)
        proc = self._process(logits, slots, flags, batch, token_bitmask)
        tokens = proc.argmax(dim=-1)
        rnd = (flags & F_RANDOM) != 0
        q = None
        if rnd.any():
            rows = np.flatnonzero(rnd)
            r = torch.from_numpy(rows).to(self.device)
            q = distribution(proc[r], st, slots[rows])
            tokens[r] = draw(self._draw, q, st.seed[slots[rows]], positions[rows], DRAFT_ATTEMPT)
        return tokens.cpu().numpy(), rnd, q

    def _process(self, logits: torch.Tensor, slots: np.ndarray, flags: np.ndarray, batch: int,
                 token_bitmask: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """logit_bias, the min_tokens ban, penalties and grammar masks, on a copy (the raw logits are still
        needed for logprobs)."""
        if not batch & (F_BIAS | F_MIN_TOKENS | F_PENALTY | F_GRAMMAR):
            return logits
        proc = self._scratch.get("proc", *logits.shape).copy_(logits)
        dev, st = self.device, self.state
        if batch & F_BIAS:
            rows = np.flatnonzero(flags & F_BIAS)
            r = torch.from_numpy(rows).to(dev)
            s = torch.from_numpy(slots[rows]).to(dev)
            ids = st.bias.ids[s]
            assert st.bias.values is not None
            # accumulate: padding repeats a real id with bias 0, so duplicates must add rather than overwrite.
            proc.index_put_((r[:, None].expand_as(ids), ids), st.bias.values[s], accumulate=True)
        if batch & F_MIN_TOKENS:
            rows = np.flatnonzero(flags & F_MIN_TOKENS)
            r = torch.from_numpy(rows).to(dev)
            ids = st.ban.ids[torch.from_numpy(slots[rows]).to(dev)]
            proc[r[:, None].expand_as(ids), ids] = float("-inf")
        if batch & F_PENALTY:
            penalize(proc, slots, flags, st, self._seen)
        if token_bitmask is not None:
            apply_token_bitmask(proc, *token_bitmask)
        return proc

    def _logsumexp(self, x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """Row log-sum-exp given the row max (reused from the greedy max on the fast path).

        A single CPU row's exponentials are summed as one of two rows: torch splits a lone row's sum over its
        threads (another order than the per-row sum it runs for two rows or more), which gave a request other
        logprob bits alone than in a batch. Only the sum sees the second row (a stride-0 view): the
        exponentials, the costly part, are computed once."""
        shifted = torch.sub(x, row_max, out=self._scratch.get("lse", *x.shape)).exp_()
        if x.shape[0] == 1 and x.device.type == "cpu":
            return row_max.reshape(1) + shifted.expand(2, -1).sum(-1)[:1].log_()
        return row_max.squeeze(1) + shifted.sum(-1).log_()


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first index of the max) per row, as `logits.max(dim=-1)`. On CPU numpy's SIMD argmax: torch's
    indexed max over a 262k vocabulary row took ~0.3 ms (10x numpy's), a few percent of a small model's decode
    step; both return the first maximal index (NaN counting as the maximum)."""
    if logits.device.type != "cpu":
        values, indices = logits.max(dim=-1)
        return values, indices
    indices = torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.gather(1, indices[:, None]).squeeze(1), indices
