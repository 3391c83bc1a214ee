"""Draft-model proposals and their exact verification (modified rejection sampling).

The draft draws token d from its distribution q; the target row, with distribution p, keeps d with probability
min(1, p(d) / q(d)) and otherwise draws from normalize(max(p - q, 0)). Whatever q is, the kept-or-redrawn token is
distributed as p, so the output is the target's. p and q are the full filtered distributions (temperature, top-k,
top-p, min-p: the same kept set as filters.TokenDraw draws from, computed here densely because the rule needs
p(d), q(d) and p - q over the whole vocabulary).

Each draw has its own counter-based uniform (rng.py) at the row's output position, in attempt numbers no other
draw uses, so a seeded request's speculative output repeats run after run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ironlm.sampler.filters import TokenDraw
from ironlm.sampler.rng import uniforms
from ironlm.sampler.state import F_MIN_P, F_TOP_K, F_TOP_P, SlotState

# Attempt numbers of the three draws at one position (TokenDraw uses 0..MAX_REJECTION_ROUNDS).
DRAFT_ATTEMPT = 1 << 20
ACCEPT_ATTEMPT = DRAFT_ATTEMPT + 1
RESIDUAL_ATTEMPT = DRAFT_ATTEMPT + 2


@dataclass
class Drafts:
    """A step's draft proposals, aligned with the plan's sample rows that verify one (`sample_draft >= 0`)."""

    rows: np.ndarray  # [R] int64 sample rows
    tokens: np.ndarray  # [R] int64 the proposed token each row verifies
    random: np.ndarray  # [R] bool: drawn from q (the others are the draft's greedy choice)
    probs: torch.Tensor | None  # [random.sum(), V] float32 q of the random rows, in order


def distribution(logits: torch.Tensor, state: SlotState, slots: np.ndarray) -> torch.Tensor:
    """Rows of `logits` (already biased / masked) -> the distributions a random row of those slots draws from,
    float32 [R, V] summing to 1: e = exp((l - max) / T) kept where e >= max(k-th largest e, the top-p threshold
    over the top-k set, min_p); ties at a threshold are all kept, as in TokenDraw."""
    dev = logits.device
    flags = state.flags[slots]
    inv_t = torch.from_numpy(state.inv_temp[slots]).to(dev)[:, None]
    e = (logits - logits.amax(dim=-1, keepdim=True)).mul_(inv_t).exp_()
    R, V = e.shape
    thresh = torch.zeros(R, 1, device=dev)
    has_k, has_p = (flags & F_TOP_K) != 0, (flags & F_TOP_P) != 0
    if (has_k | has_p).any():
        vals = e.sort(dim=-1, descending=True).values
        if has_k.any():
            k = torch.from_numpy(np.where(has_k, state.top_k[slots], V)).to(dev)[:, None]
            thresh = torch.where(torch.from_numpy(has_k).to(dev)[:, None], vals.gather(1, k - 1), thresh)
        if has_p.any():
            in_k = vals * (vals >= thresh)
            cum = in_k.cumsum(-1, dtype=torch.float64)
            top_p = torch.from_numpy(state.top_p[slots]).to(dev)[:, None]
            n_keep = (cum < top_p * cum[:, -1:]).sum(-1, keepdim=True) + 1
            p_thresh = vals.gather(1, n_keep.clamp(max=V) - 1)
            thresh = torch.where(torch.from_numpy(has_p).to(dev)[:, None], torch.maximum(thresh, p_thresh), thresh)
    if (flags & F_MIN_P).any():
        thresh = torch.maximum(thresh, torch.from_numpy(state.min_p[slots]).to(dev)[:, None])
    e = e * (e >= thresh)
    return e / e.sum(-1, keepdim=True)


def draw(td: TokenDraw, probs: torch.Tensor, seeds: np.ndarray, positions: np.ndarray,
         attempt: int) -> torch.Tensor:
    """One token per row of `probs` (unnormalised is fine) by inverse CDF with that row's uniform."""
    u = torch.from_numpy(uniforms(seeds, positions, attempt)).to(probs.device)
    return td.inverse_cdf(probs.contiguous(), u)


def verify(td: TokenDraw, p: torch.Tensor, q: torch.Tensor, proposed: torch.Tensor, seeds: np.ndarray,
           positions: np.ndarray) -> torch.Tensor:
    """The token each row emits: `proposed` where kept (probability min(1, p/q)), else a draw from the residual
    normalize(max(p - q, 0)). The residual has no mass on a rejected proposal (p < q there), so a rejected row's
    token always differs from its proposal: the core's "sampled == proposed" test then cuts the run there."""
    dev = p.device
    idx = proposed[:, None]
    pd, qd = p.gather(1, idx).squeeze(1).double(), q.gather(1, idx).squeeze(1).double()
    u = torch.from_numpy(uniforms(seeds, positions, ACCEPT_ATTEMPT)).to(dev)
    keep = u * qd < pd
    residual = (p - q).clamp_(min=0.0)
    # No residual mass only when p == q (then every proposal is kept): draw from p not to divide by zero.
    empty = residual.sum(-1) <= 0
    if bool(empty.any()):
        residual[empty] = p[empty]
    redrawn = draw(td, residual, seeds, positions, RESIDUAL_ATTEMPT)
    return torch.where(keep, proposed, redrawn)
