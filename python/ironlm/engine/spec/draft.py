"""The draft model: a smaller model sharing the target's tokenizer proposes each speculating sequence's next k
tokens, k cheap decode steps per engine step.

Its KV lives in a pool of its own with the target pool's block ids: the core's block tables and slot mappings
index both, so the draft's KV blocks are allocated, grown for the lookahead, rolled back and freed with the
target's, and the engine sizes the target pool for both (ModelRunner's `extra_block_bytes`): one accounting, one
allocator, no second set of tables to keep in step. The draft never trusts a block it did not fill for the
sequence at hand (a prefix-cache hit, a copy-on-write copy, a tier promotion hold the target's KV only): each slot
records how many leading positions hold its own draft KV (`valid`), and the draft's first forward of a step runs
from there (a whole prompt the first time, one or two tokens after).

Flow of one engine step: `schedule` reserves proposal rows (the core's external mode) -> `propose` runs the
draft (catch-up plus the first proposal, then one token a forward), hands the tokens to the core
(`set_proposals`) and returns their q for the sampler's rejection rule -> the target verifies -> `settle` moves
each slot's `valid` past the accepted run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ironlm import _core
from ironlm.attention import AttentionMetadata, get_backend
from ironlm.config import EngineConfig
from ironlm.engine.kv_cache import (
    KVCaches,
    allocate_kv_caches,
    bytes_per_block,
    quantized_auto,
    resolve_kv_dtype,
)
from ironlm.exceptions import InvalidArgumentError, UnsupportedModelError
from ironlm.model import load_model, resolve_device
from ironlm.sampler import Sampler
from ironlm.sampler.rejection import Drafts
from ironlm.spec_config import SpeculativeConfig

logger = logging.getLogger("ironlm.engine")


@dataclass
class _Run:
    """This step's speculating sequences, in plan order."""

    slots: np.ndarray  # [N]
    first: np.ndarray  # [N] sample row verifying the first proposal
    k: np.ndarray  # [N] proposals reserved
    length: np.ndarray  # [N] tokens known (the last one's KV is computed this step)


class DraftModel:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig) -> None:
        assert spec.model is not None
        if config.tensor_parallel_size > 1:
            raise InvalidArgumentError("speculative_config.model: a draft model needs tensor_parallel_size 1",
                                       "speculative_config.model")
        self.device = device = resolve_device(config.device)
        loaded = load_model(spec.model, dtype=config.dtype, device=device,
                            attn_backend=get_backend(config.attention_backend, device),
                            quantization=config.quantization,
                            quantization_group_size=config.quantization_group_size)
        loaded.model.batch_invariant = config.batch_invariant
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.model.dtype
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, device, quantized_auto(config.dtype,
                                                                                                  loaded.model))
        self.block_size = config.block_size
        self.block_bytes = bytes_per_block(loaded.config, config.block_size, self.kv_dtype)
        self.weight_bytes = loaded.model.weight_bytes()
        self.kv: KVCaches = []
        self.vocab_size = 0
        self.valid = np.zeros(0, np.int64)  # per slot: positions < valid hold this sequence's draft KV
        self._run: _Run | None = None
        self.catchup_seconds = 0.0  # this step's prompt catch-up beyond a one-token forward (see `propose`)

    def attach(self, target_tokenizer: object, vocab_size: int, num_blocks: int) -> None:
        """Check the tokenizers agree and allocate the draft pool: `num_blocks` blocks, the target's ids."""
        mine, theirs = self.tokenizer.get_vocab(), target_tokenizer.get_vocab()  # type: ignore[attr-defined]
        if mine != theirs:
            diff = len(set(mine.items()) ^ set(theirs.items()))
            raise UnsupportedModelError(f"speculative_config.model: the draft's tokenizer differs from the target's "
                                        f"({len(mine)} vs {len(theirs)} tokens, {diff} entries differ)")
        self.vocab_size = vocab_size
        self.kv = allocate_kv_caches(self.model_config, num_blocks, self.block_size, self.kv_dtype, self.device)

    def forget(self, slots: list[int] | np.ndarray) -> None:
        """These slots' blocks may hold other KV now (a new sequence, a preemption): recompute from 0."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots):
            self._grow(int(slots.max()) + 1)
            self.valid[slots] = 0

    def _grow(self, n: int) -> None:
        if n > len(self.valid):
            self.valid = np.concatenate([self.valid, np.zeros(max(n, 2 * len(self.valid)) - len(self.valid),
                                                              np.int64)])

    # ---- one step -------------------------------------------------------------------------------------

    def propose(self, plan: _core.SchedulerPlan, scheduler: _core.Scheduler, sampler: Sampler) -> Drafts | None:
        """Fill the plan's reserved proposal rows (None: the plan has none)."""
        self._run = None
        self.catchup_seconds = 0.0
        sd = plan.sample_draft
        rows = np.flatnonzero(sd >= 0)
        if not len(rows):
            return None
        first = rows[(rows == 0) | (sd[np.maximum(rows - 1, 0)] < 0)]
        ends = np.flatnonzero(sd < 0)  # a sequence's rows end at its first row without a proposal
        k = ends[np.searchsorted(ends, first)] - first
        ss, li = plan.sample_slots, plan.logits_indices
        slots = ss[first]
        length = plan.positions[li[first]] + 1
        self._grow(int(slots.max()) + 1)
        seq = np.searchsorted(plan.query_start_loc, li[first], side="right") - 1
        tables = plan.block_tables[seq]
        self._run = _Run(slots, first, k, length)
        out = np.empty(len(rows), np.int64)
        random = np.zeros(len(rows), bool)
        q: dict[int, torch.Tensor] = {}  # proposal index -> its q (random rows only)
        # Forward 1: from each slot's valid draft KV up to its last known token; its logits give proposal 1.
        start = self.valid[slots]
        start = np.where((start > 0) & (start <= length - 1), start, 0)
        ids = [plan.input_ids[li[f]:li[f] + 1] if s == n - 1 else
               np.asarray(scheduler.token_ids(int(sl))[s:n], np.int64)
               for f, s, n, sl in zip(first, start, length, slots, strict=True)]
        t0 = time.perf_counter()
        logits = self._forward(ids, [np.arange(s, n) for s, n in zip(start, length, strict=True)], start, tables)
        first_s, rest_s = time.perf_counter() - t0, 0.0
        prev = np.zeros(len(first), np.int64)
        constrained = len(plan.mask_rows) > 0
        for j in range(int(k.max())):
            live = np.flatnonzero(k > j)
            if j > 0:  # then one token a forward: the previous proposal, right after the known tokens
                pos = length[live] + j - 1
                t0 = time.perf_counter()
                logits = self._forward([prev[i:i + 1] for i in live], [p[None] for p in pos], pos, tables[live])
                rest_s += time.perf_counter() - t0
            r = first[live] + j
            # A grammar's sequences propose only what it allows after their proposals so far (the core walks
            # their matchers and rolls them back in `set_proposals`).
            masks = scheduler.draft_masks(r, prev[live] if j else np.full(len(r), -1)) if constrained else None
            tok, rnd, qr = sampler.propose(logits, ss[r], plan.sample_output_lens[r], plan.sample_ban_stop[r],
                                           token_bitmask=masks)
            at = np.searchsorted(rows, r)
            out[at], random[at], prev[live] = tok, rnd, tok
            if qr is not None:
                q.update(zip(at[rnd].tolist(), qr, strict=True))
        # A sequence new to the draft (or forgotten) made the first forward a prompt's prefill: what it took beyond
        # a one-token forward is paid once a sequence, whatever the budget, and is not what a step of these rows
        # costs (counted as such, one request's catch-up made the full budget look slow for the cost model).
        if (length - start).max() > 2:
            self.catchup_seconds = max(0.0, first_s - (rest_s / (int(k.max()) - 1) if k.max() > 1 else 0.0))
        scheduler.set_proposals(plan, out)
        probs = torch.stack([q[a] for a in np.flatnonzero(random).tolist()]) if random.any() else None
        return Drafts(rows, out, random, probs)

    def _forward(self, ids: list[np.ndarray], positions: list[np.ndarray], context: np.ndarray,
                 tables: np.ndarray) -> torch.Tensor:
        """One draft forward over each sequence's `ids` at `positions` (its KV before `context` already in the
        draft pool); logits of each sequence's last row, widened / cut to the target's vocabulary."""
        bs = self.block_size
        pos = np.concatenate(positions).astype(np.int64)
        lens = np.array([len(p) for p in positions], np.int64)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        seq = np.repeat(np.arange(len(lens)), lens)
        slot_mapping = tables[seq, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = np.asarray(context, np.int64) + lens
        dev = self.device
        meta = AttentionMetadata.from_numpy(
            slot_mapping=slot_mapping, query_start_loc=qsl, seq_lens=seq_lens,
            context_lens=np.asarray(context, np.int64), block_tables=tables,
            max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()), device=dev)
        input_ids = torch.from_numpy(np.concatenate(ids).astype(np.int64)).to(dev)
        with torch.inference_mode():
            logits = self.model(input_ids, torch.from_numpy(pos).to(dev), self.kv, meta,
                                torch.from_numpy(qsl[1:] - 1).to(dev))
        V = self.vocab_size
        if logits.shape[1] > V:
            logits = logits[:, :V]
        elif logits.shape[1] < V:
            logits = torch.nn.functional.pad(logits, (0, V - logits.shape[1]), value=float("-inf"))
        return logits

    def settle(self, emitted: np.ndarray) -> None:
        """After `update`: a slot's draft KV is right through the accepted proposals it computed (it never
        computed the k-th one, nor the token the target chose after the run)."""
        run = self._run
        if run is None:
            return
        self._run = None
        counts = np.array([emitted[f:f + k + 1].sum() for f, k in zip(run.first, run.k, strict=True)], np.int64)
        accepted = np.minimum(counts - 1, run.k - 1)
        self.valid[run.slots] = np.where(counts > 0, run.length + accepted, 0)
