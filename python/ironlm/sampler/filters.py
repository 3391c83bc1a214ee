"""Drawing the random rows: temperature, then top-k / top-p / min-p, by inverse CDF.

A row's token is drawn by inverse CDF over the filtered distribution laid out in token-id order, with one
counter-based uniform per row (see rng.py) instead of V Gumbel samples. Costs are kept to a few vocab-wide passes
per step: the inverse CDF is two-level (block sums, then a cumsum inside one block), top-k and top-N logprobs use
a topk over the blocks with the largest maxima, and top-p without top-k uses rejection sampling against the
nucleus (accepted with probability >= top_p per attempt, so no vocab-wide sort).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ironlm.sampler.rng import U_MAX, uniforms
from ironlm.sampler.scratch import Scratch
from ironlm.sampler.state import F_MIN_P, F_TOP_K, F_TOP_P, SlotState

# Top-p rejection attempts before a row falls back to an exact sort (only tiny top_p on flat rows get there).
MAX_REJECTION_ROUNDS = 16


class TokenDraw:
    """The random-row draws of one vocabulary, on one device. Per-row arguments are aligned with the rows drawn:
    `slots` (their parameters in `state`) and `positions` (their tokens generated so far: the stream position)."""

    def __init__(self, vocab_size: int, device: torch.device, state: SlotState, scratch: Scratch) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.state = state
        self.scratch = scratch
        # Inverse-CDF block: a divisor of V near sqrt(V) avoids padding; otherwise pad the row to a multiple.
        self.block = next((b for b in (256, 512, 128, 1024, 64) if vocab_size % b == 0), 256)
        self.pad = -vocab_size % self.block

    def random_rows(self, proc: torch.Tensor, tokens: torch.Tensor, rows: np.ndarray, slots: np.ndarray,
                    positions: np.ndarray, row_max: torch.Tensor | None) -> None:
        """Write into `tokens[rows]` the draws of those rows of `proc` (row i belongs to `slots[i]`)."""
        dev, st = self.device, self.state
        sl_all, pos_all = slots[rows], positions[rows]
        flags = st.flags[sl_all]
        has_k = (flags & F_TOP_K) != 0
        nucleus = ((flags & F_TOP_P) != 0) & ~has_k
        for part, kind in ((has_k, "top_k"), (nucleus, "top_p"), (~(has_k | nucleus), "full")):
            idx = np.flatnonzero(part)
            if not len(idx):
                continue
            r = torch.from_numpy(rows[idx]).to(dev)
            if len(idx) == proc.shape[0]:
                sub, m = proc, row_max
            else:
                sub = torch.index_select(proc, 0, r, out=self.scratch.get("rows", len(idx), proc.shape[1]))
                m = None if row_max is None else row_max[r]
            sl, pos = sl_all[idx], pos_all[idx]
            inv_t = torch.from_numpy(st.inv_temp[sl]).to(dev)[:, None]
            min_p = None
            if (flags[idx] & F_MIN_P).any():
                min_p = torch.from_numpy(st.min_p[sl]).to(dev)[:, None]
            if kind == "top_k":
                tokens[r] = self.top_k(sub, inv_t, min_p, sl, pos)
                continue
            # e = exp((l - max) / T): the unnormalised filtered distribution; its max is 1, so min-p is e >= p.
            # Computed into a buffer padded to whole inverse-CDF blocks (zero mass in the padding).
            V = sub.shape[1]
            padded = self.scratch.get("e", len(idx), V + self.pad)
            if self.pad:
                padded[:, V:].zero_()
            m = sub.amax(dim=-1, keepdim=True) if m is None else m
            e = torch.sub(sub, m, out=padded[:, :V]).mul_(inv_t).exp_()
            mass = total = None
            if kind == "top_p":  # the nucleus is defined before min-p; block sums give the total for free
                mass = padded.view(len(idx), -1, self.block).sum(-1)
                total = mass.sum(-1)
            if min_p is not None:
                e.masked_fill_(e < min_p, 0.0)
                mass = None
            if kind == "full":
                u = torch.from_numpy(uniforms(st.seed[sl], pos)).to(dev)
                tokens[r] = self.inverse_cdf(padded, u)
            else:
                assert total is not None
                tokens[r] = self.top_p(padded, total, sl, pos, mass)

    def inverse_cdf(self, e: torch.Tensor, u: torch.Tensor, mass: torch.Tensor | None = None) -> torch.Tensor:
        """Token t with P(t) proportional to e[t] (token-id order), u uniform [0, 1): pick a block of the vocab
        by the cumsum of block masses, then a token by the cumsum inside that block (float64 both times), so
        the cost is one pass for the block sums instead of a vocab-wide float64 cumsum. `e` may already be
        padded to whole blocks."""
        R = e.shape[0]
        B = self.block
        if e.shape[1] == self.vocab_size and self.pad:
            e = F.pad(e, (0, self.pad))
        blocks = e.contiguous().view(R, -1, B)
        mass = blocks.sum(-1) if mass is None else mass
        cdf = mass.cumsum(-1, dtype=torch.float64)
        target = u[:, None] * cdf[:, -1:]
        b = torch.searchsorted(cdf, target, right=True).clamp_(max=mass.shape[1] - 1)
        before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)), 0.0)
        frac = ((target - before) / mass.gather(1, b).double()).clamp_(0.0, U_MAX)
        inner = blocks.gather(1, b[:, :, None].expand(-1, 1, B)).squeeze(1).cumsum(-1, dtype=torch.float64)
        pos = torch.searchsorted(inner, frac * inner[:, -1:], right=True).clamp_(max=B - 1)
        # The clamp only matters for a row with no mass at all (e.g. NaN logits): never return a padding id.
        return (b * B + pos).squeeze(1).clamp_(max=self.vocab_size - 1)

    def top_p(self, e: torch.Tensor, total: torch.Tensor, slots: np.ndarray, positions: np.ndarray,
              mass: torch.Tensor | None) -> torch.Tensor:
        """Top-p by rejection: draw from e, accept if the mass strictly above the draw is < p * total (i.e. the
        token is in the nucleus; equal values are all kept). On rejection, every token not above the draw is
        outside the nucleus too, so it is removed before the next attempt. Accepted draws follow e restricted
        to the nucleus exactly; each attempt succeeds with probability >= top_p."""
        dev, st = self.device, self.state
        out = torch.empty(e.shape[0], dtype=torch.long, device=dev)
        pending = np.arange(e.shape[0])
        limit = torch.from_numpy(st.top_p[slots]).to(dev) * total
        for attempt in range(MAX_REJECTION_ROUNDS):
            sl, pos = slots[pending], positions[pending]
            u = torch.from_numpy(uniforms(st.seed[sl], pos, attempt)).to(dev)
            tok = self.inverse_cdf(e, u, mass)
            mass = None  # rejected rows get masked below
            ex = e.gather(1, tok[:, None])
            # sum(e * [e > ex]) with the comparison written as float into a reused buffer: 2 passes on CPU,
            # where a bool mask, torch.where or an einsum each cost several times more.
            above = torch.gt(e, ex, out=self.scratch.get("tmp", *e.shape)).mul_(e).sum(-1)
            ok = (above < limit).cpu().numpy()
            out[torch.from_numpy(pending[ok]).to(dev)] = tok[torch.from_numpy(ok).to(dev)]
            if ok.all():
                return out
            keep = torch.from_numpy(~ok).to(dev)
            e, ex, limit = e[keep], ex[keep], limit[keep]
            e.masked_fill_(e <= ex, 0.0)
            pending = pending[~ok]
        # Exact fallback: sort the (few) remaining rows.
        sl, pos = slots[pending], positions[pending]
        vals = e.sort(dim=-1, descending=True).values
        cum = vals.cumsum(-1, dtype=torch.float64)
        n_keep = (cum < limit[:, None]).sum(-1, keepdim=True) + 1
        thresh = vals.gather(1, n_keep.clamp(max=vals.shape[1]) - 1)
        e = e.masked_fill(e < thresh, 0.0)
        u = torch.from_numpy(uniforms(st.seed[sl], pos, MAX_REJECTION_ROUNDS)).to(dev)
        out[torch.from_numpy(pending).to(dev)] = self.inverse_cdf(e, u)
        return out

    def top_k(self, sub: torch.Tensor, inv_t: torch.Tensor, min_p: torch.Tensor | None, slots: np.ndarray,
              positions: np.ndarray) -> torch.Tensor:
        """Top-k (then top-p renormalised over the top-k set, then min-p) on the `topk(k + 1)` candidates.

        The kept set is {e >= threshold}, so equal values at the boundary are all kept and the result does not
        depend on how topk orders ties; it is trusted once the last candidate is below the threshold (or has no
        mass), which proves nothing outside the candidates would be kept; otherwise more candidates are taken.
        """
        dev, st, V = self.device, self.state, sub.shape[1]
        k = torch.from_numpy(st.top_k[slots]).to(dev)[:, None]
        has_p = (st.flags[slots] & F_TOP_P) != 0
        top_p = torch.from_numpy(np.where(has_p, st.top_p[slots], 2.0)).to(dev)[:, None]
        u_all = torch.from_numpy(uniforms(st.seed[slots], positions)).to(dev)
        out = torch.empty(sub.shape[0], dtype=torch.long, device=dev)
        pending = torch.arange(sub.shape[0], device=dev)
        K = min(V, int(st.top_k[slots].max()) + 1)
        while True:
            rows = sub if len(pending) == sub.shape[0] else sub[pending]
            vals, idx = self.topk(rows, K)  # sorted descending
            e = (vals - vals[:, :1]).mul_(inv_t[pending]).exp_()
            kk = k[pending]
            thresh = e.gather(1, kk.clamp(max=K) - 1)
            if has_p.any():
                in_k = e * (e >= thresh)
                cum = in_k.cumsum(-1, dtype=torch.float64)
                pp = top_p[pending]
                n_keep = (cum < pp * cum[:, -1:]).sum(-1, keepdim=True) + 1
                p_thresh = e.gather(1, n_keep.clamp(max=K) - 1)
                thresh = torch.where(pp <= 1.0, torch.maximum(thresh, p_thresh), thresh)
            if min_p is not None:
                thresh = torch.maximum(thresh, min_p[pending])
            last = e[:, -1:]
            ok = ((last < thresh) | (last == 0)).squeeze(1) if K < V else torch.ones_like(pending, dtype=torch.bool)
            if bool(ok.any()):
                i, w = idx[ok], e[ok]
                w = w * (w >= thresh[ok])
                # Token-id order, so the draw does not depend on how topk ordered equal values.
                order = i.argsort(dim=-1)
                i = i.gather(1, order)
                cdf = w.gather(1, order).cumsum(-1, dtype=torch.float64)
                target = u_all[pending[ok]][:, None] * cdf[:, -1:]
                pos = torch.searchsorted(cdf, target, right=True).clamp_(max=K - 1)
                out[pending[ok]] = i.gather(1, pos).squeeze(1)
            pending = pending[~ok]
            if not len(pending):
                return out
            K = min(V, K * 8)

    def topk(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row top-k (values sorted descending) through block maxima: the top k values all lie in the k blocks
        with the largest maxima (a block holding one of them has a max at least as large), so a topk over those
        k blocks replaces one over the whole vocabulary. Equal values may come back with other ids than
        torch.topk would pick; the values are the same."""
        R, V = x.shape
        nb = V // self.block
        if self.pad or 2 * k > nb:
            return x.topk(k, dim=-1)
        blocks = x.contiguous().view(R, nb, self.block)
        top_blocks = blocks.amax(dim=-1).topk(k, dim=-1).indices
        cand = blocks.gather(1, top_blocks[:, :, None].expand(-1, -1, self.block)).view(R, -1)
        vals, pos = cand.topk(k, dim=-1)
        return vals, top_blocks.gather(1, pos // self.block) * self.block + pos % self.block
