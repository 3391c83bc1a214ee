"""Routing for every MoE family in one function: router logits [T, E] -> each token's top-k expert ids and their
combine weights.

The families differ only in these knobs (`RouteSpec`):

- scoring: ``softmax`` over all experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2), ``sigmoid`` per expert
  (DeepSeek-V3), or ``topk_softmax``: top-k of the raw logits, then a softmax over those k (gpt-oss);
- ``renormalize``: the k weights divided by their sum (Mixtral always, Qwen / OLMoE / DeepSeek-V3 when
  ``norm_topk_prob``), with ``renorm_eps`` in the denominator (DeepSeek-V3's 1e-20);
- group-limited selection (DeepSeek): experts in ``n_group`` groups, only the best ``topk_group`` groups compete;
  a group scores by its best expert (``group_score="max"``, V2) or the sum of its best two (``"top2_sum"``, V3);
- a logit bias (gpt-oss's router bias, added before anything else) and a score-correction bias (DeepSeek-V3's
  ``e_score_correction_bias``), which steers selection only: the weights come from the uncorrected scores;
- ``scaling``: the final weights times ``routed_scaling_factor``.

Scores are computed in float32 whatever the activations' dtype (transformers upcasts the same way), and so are
the returned weights.
"""

from __future__ import annotations

import torch

from ironlm.model.moe.spec import RouteSpec

__all__ = ["RouteSpec", "route"]


def route(logits: torch.Tensor, spec: RouteSpec, logit_bias: torch.Tensor | None = None,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    logits = logits.float()
    if logit_bias is not None:
        logits = logits + logit_bias.float()
    if spec.scoring == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return _finish(torch.softmax(top, dim=-1), ids, spec)
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if correction is None else scores + correction.float()
    if spec.grouped:
        choice = _mask_groups(choice, spec)
    if correction is None and not spec.grouped:
        weights, ids = torch.topk(choice, spec.top_k, dim=-1)
    else:
        ids = torch.topk(choice, spec.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
    return _finish(weights, ids, spec)


def _mask_groups(choice: torch.Tensor, spec: RouteSpec) -> torch.Tensor:
    """Experts outside each token's best `topk_group` groups set to -inf (never chosen)."""
    t, e, g = choice.shape[0], spec.num_experts, spec.n_group
    grouped = choice.view(t, g, e // g)
    if spec.group_score == "max":
        group = grouped.max(dim=-1).values
    else:
        group = grouped.topk(min(2, e // g), dim=-1)[0].sum(dim=-1)
    keep = torch.zeros_like(group, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group, spec.topk_group, dim=-1)[1], True)
    return choice.masked_fill(~keep.repeat_interleave(e // g, dim=1), float("-inf"))


def _finish(weights: torch.Tensor, ids: torch.Tensor, spec: RouteSpec) -> tuple[torch.Tensor, torch.Tensor]:
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.renorm_eps)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return weights, ids
