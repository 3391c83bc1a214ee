"""Prompt logprobs (SamplingParams.prompt_logprobs), computed in the forward that prefills the prompt.

The runner computes logits only for the rows the plan samples. For a request that asks for prompt logprobs the
engine appends that request's prompt rows of the step to them (`PromptLogprobs.rows`), chunk by chunk under a
chunked prefill, and turns their logits into entries here (`record`): row p's logits predict prompt token p + 1.

A prefix-cache hit would leave rows uncomputed, so the engine adds such a request under a namespace of its own
(`namespace`): its whole prompt is recomputed, never read from the cache, and the logprobs are never stored. A
preempted request whose prompt was already scored is not tracked any more: its recompute adds no rows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ironlm.engine.outputs import Logprob

if TYPE_CHECKING:
    from ironlm import _core
    from ironlm.engine.sequence_table import EngineRequest, SequenceTable

# Rows turned into logprobs at a time: log_softmax copies its input, so a long prefill chunk with a large
# vocabulary is done in slices rather than doubling the logits' memory at once.
_SLICE_ROWS = 512


def namespace() -> str:
    """A prefix-cache namespace no other request shares (random: request ids repeat across restarts, and a disk
    KV tier outlives them)."""
    return f"prompt-logprobs/{uuid.uuid4().hex}"


@dataclass(eq=False)
class _Pending:
    request: EngineRequest
    slots: tuple[int, ...]
    done: np.ndarray  # [prompt_len] bool: target positions given a row already (0 never needs one)
    left: int  # target positions 1..prompt_len-1 still without a row


@dataclass
class PromptRows:
    """The prompt rows of one step: token rows of the plan, the prompt token each predicts, whose it is."""

    rows: np.ndarray  # int64 [E] rows of the plan's token batch
    targets: np.ndarray  # int64 [E]
    owners: list[tuple[EngineRequest, np.ndarray]] = field(default_factory=list)  # request, its target positions


class PromptLogprobs:
    """The requests whose prompt logprobs are still being computed, by slot (engine thread only)."""

    def __init__(self) -> None:
        self._by_slot: dict[int, _Pending] = {}

    def __len__(self) -> int:
        return len({id(p) for p in self._by_slot.values()})

    def add(self, request: EngineRequest, slots: list[int]) -> None:
        """Track a request the core accepted (every sequence slot: n > 1 prefills under any of them)."""
        n = len(request.prompt_token_ids)
        request.prompt_logprobs = [None] * n
        if n <= 1:
            return
        done = np.zeros(n, dtype=bool)
        done[0] = True
        pending = _Pending(request, tuple(slots), done, n - 1)
        for slot in slots:
            self._by_slot[slot] = pending

    def _drop(self, pending: _Pending) -> None:
        for slot in pending.slots:
            if self._by_slot.get(slot) is pending:
                del self._by_slot[slot]

    def rows(self, plan: _core.SchedulerPlan, table: SequenceTable) -> PromptRows | None:
        """This step's prompt rows, or None when no tracked request has any (then the step is untouched)."""
        if not self._by_slot:
            return None
        for tracked in {id(p): p for p in self._by_slot.values()}.values():
            if table.requests.get(tracked.request.request_id) is not tracked.request:  # aborted, failed
                self._drop(tracked)
        if not self._by_slot:
            return None
        seq_slots = plan.seq_slots
        batch = np.flatnonzero(np.isin(seq_slots, np.fromiter(self._by_slot, dtype=np.int64)))
        if not len(batch):
            return None
        qsl, positions = plan.query_start_loc, plan.positions
        rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        out = PromptRows(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        for i in batch.tolist():
            pending = self._by_slot.get(int(seq_slots[i]))
            if pending is None:
                continue
            start, end = int(qsl[i]), int(qsl[i + 1])
            target = positions[start:end] + 1
            n = len(pending.done)
            keep = target < n
            keep[keep] = ~pending.done[target[keep]]
            if keep.any():
                want = target[keep]
                pending.done[want] = True
                pending.left -= len(want)
                rows.append(np.arange(start, end, dtype=np.int64)[keep])
                prompt = np.asarray(pending.request.prompt_token_ids, dtype=np.int64)
                targets.append(prompt[want])
                out.owners.append((pending.request, want))
            if pending.left <= 0:
                self._drop(pending)
        if not rows:
            return None
        out.rows, out.targets = np.concatenate(rows), np.concatenate(targets)
        return out

    @staticmethod
    def record(rows: PromptRows, logits: torch.Tensor, tokenizer: Any) -> None:
        """Fill the owners' entries from the logits of `rows` ([E, vocab] float32, in `rows.rows` order): the raw
        logprob of the prompt token and its rank (1 + how many tokens are likelier), plus the top-k."""
        top = max(r.params.prompt_logprobs or 0 for r, _ in rows.owners)
        targets = torch.from_numpy(rows.targets).to(logits.device)
        chosen_l: list[float] = []
        rank_l: list[int] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        for s in range(0, logits.shape[0], _SLICE_ROWS):
            lp = torch.log_softmax(logits[s:s + _SLICE_ROWS].float(), dim=-1)
            chosen = lp.gather(1, targets[s:s + _SLICE_ROWS, None])
            chosen_l += chosen[:, 0].tolist()
            rank_l += ((lp > chosen).sum(dim=1) + 1).tolist()
            if top:
                values, ids = lp.topk(top, dim=-1)
                top_ids += ids.tolist()
                top_lps += values.tolist()
        names: dict[int, str] = {}

        def name(tid: int) -> str:
            if tid not in names:
                names[tid] = str(tokenizer.decode([tid]))
            return names[tid]

        target_l = rows.targets.tolist()
        j = 0
        for request, positions in rows.owners:
            k = request.params.prompt_logprobs or 0
            store = request.prompt_logprobs
            assert store is not None
            for pos in positions.tolist():
                tid = target_l[j]
                entry = {tid: Logprob(chosen_l[j], rank=rank_l[j], decoded_token=name(tid))}
                for r in range(k):
                    alt = top_ids[j][r]
                    if alt not in entry:
                        entry[alt] = Logprob(top_lps[j][r], rank=r + 1, decoded_token=name(alt))
                store[pos] = entry
                j += 1
