"""vLLM's repetition / presence / frequency penalties, on the tokens a sequence has seen only.

Penalties touch the tokens in a sequence's prompt + output token list (take/put over it), never the whole
vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ironlm.sampler.state import F_FREQ, F_PENALTY, F_PRES, F_REP, SlotState


class SeenTokens:
    """Penalty state: for each penalised sequence, the distinct tokens it has seen and their output counts.

    Rows of a pool (one per penalised slot). Device: `ids[row, :len]` (prompt tokens when a repetition penalty
    needs them, then each new output token) and `counts[row, :len]` (output occurrences). Host: `pos[row, tok]`,
    the position of `tok` in the row (-1 if unseen), which keeps the lists duplicate-free without a device sync.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.pos = np.zeros((0, vocab_size), np.int32)
        self.length = np.zeros(0, np.int64)
        self.ids = torch.zeros(0, 16, dtype=torch.long, device=device)
        self.counts = torch.zeros(0, 16, dtype=torch.int32, device=device)
        self.free: list[int] = []

    # `record` grows the pool inside the sampler's inference mode, making these inference tensors; every other
    # update must run in inference mode too, or torch refuses the in-place write (a finish then fails).
    @torch.inference_mode()
    def alloc(self) -> int:
        if not self.free:
            old = len(self.length)
            new = max(8, 2 * old)
            self.pos = np.concatenate([self.pos, np.full((new - old, self.vocab_size), -1, np.int32)])
            self.length = np.concatenate([self.length, np.zeros(new - old, np.int64)])
            self.ids = torch.cat([self.ids, self.ids.new_zeros(new - old, self.ids.shape[1])])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.counts.shape[1])])
            self.free.extend(range(new - 1, old - 1, -1))
        return self.free.pop()

    @torch.inference_mode()
    def release(self, row: int) -> None:
        self.pos[row].fill(-1)
        self.length[row] = 0
        self.counts[row].zero_()
        self.free.append(row)

    @torch.inference_mode()
    def add_prompt(self, row: int, token_ids: Sequence[int]) -> None:
        ids = np.asarray(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        ids = ids[self.pos[row, ids] < 0]
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]  # first occurrences, in order
        n, start = len(ids), int(self.length[row])
        if not n:
            return
        self._widen(start + n)
        self.pos[row, ids] = np.arange(start, start + n, dtype=np.int32)
        self.length[row] = start + n
        self.ids[row, start:start + n] = torch.from_numpy(ids).to(self.device)

    def record(self, rows: np.ndarray, toks: np.ndarray) -> None:
        """One output token per row (rows are distinct)."""
        pos = self.pos[rows, toks].astype(np.int64)
        new = pos < 0
        if new.any():
            rn, tn = rows[new], toks[new]
            pn = self.length[rn]
            self._widen(int(pn.max()) + 1)
            self.pos[rn, tn] = pn
            self.length[rn] += 1
            pos[new] = pn
            dev = self.device
            self.ids[torch.from_numpy(rn).to(dev), torch.from_numpy(pn).to(dev)] = torch.from_numpy(tn).to(dev)
        r, p = torch.from_numpy(rows).to(self.device), torch.from_numpy(pos).to(self.device)
        self.counts.index_put_((r, p), torch.ones(len(rows), dtype=torch.int32, device=self.device),
                               accumulate=True)

    def gather(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, np.ndarray] | None:
        """(ids [R, L], counts [R, L], non-empty rows). Past a row's length, entries repeat its position 0, so a
        scatter of per-entry results writes identical values for the duplicates."""
        lens = self.length[rows]
        width = int(lens.max()) if len(lens) else 0
        if width == 0:
            return None
        dev = self.device
        ar = torch.arange(width, device=dev)
        pos = ar * (ar < torch.from_numpy(lens).to(dev)[:, None])
        r = torch.from_numpy(rows).to(dev)[:, None]
        return self.ids[r, pos], self.counts[r, pos], lens > 0

    def _widen(self, need: int) -> None:
        width = self.ids.shape[1]
        if need <= width:
            return
        while width < need:
            width *= 2
        extra = width - self.ids.shape[1]
        self.ids = torch.cat([self.ids, self.ids.new_zeros(self.ids.shape[0], extra)], dim=1)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(self.counts.shape[0], extra)], dim=1)


def penalize(proc: torch.Tensor, slots: np.ndarray, flags: np.ndarray, state: SlotState, seen: SeenTokens) -> None:
    """In place on `proc` [S, V] (row i belongs to `slots[i]`): repetition divides positive / multiplies negative
    logits of prompt+output tokens; frequency and presence subtract count * f and [count > 0] * p (outputs)."""
    rows = np.flatnonzero(flags & F_PENALTY)
    sl = slots[rows]
    got = seen.gather(state.pen_row[sl])
    if got is None:
        return
    ids, counts, nonempty = got
    dev = proc.device
    # Flat indices into the contiguous [S, V] buffer: a 1-D take/put is several times cheaper on CPU than
    # 2-D advanced indexing with a broadcast row index.
    flat = (torch.from_numpy(rows * proc.shape[1]).to(dev)[:, None] + ids).view(-1)
    g = proc.view(-1).take(flat).view(ids.shape)
    pflags = int(np.bitwise_or.reduce(flags[rows]))
    if pflags & F_REP:
        # A row with no seen tokens gathers a placeholder id: give it a neutral penalty.
        rep = torch.from_numpy(np.where(nonempty, state.rep[sl], np.float32(1.0))).to(dev)[:, None]
        g = torch.where(g > 0, g / rep, g * rep)
    if pflags & F_FREQ:
        g = g - torch.from_numpy(state.freq[sl]).to(dev)[:, None] * counts
    if pflags & F_PRES:
        g = g - torch.from_numpy(state.pres[sl]).to(dev)[:, None] * (counts > 0)
    proc.view(-1).put_(flat, g.view(-1))  # duplicates (row padding) carry identical values
