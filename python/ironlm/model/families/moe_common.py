"""What the MoE families read from their HF configs the same way: expert count, top-k, sizes, which layers are
sparse (Qwen's decoder_sparse_step / mlp_only_layers)."""

from __future__ import annotations

from typing import Any

from ironlm.model.moe.spec import MoeConfig, RouteSpec, sparse_layers


def hf_moe(hf_config: Any, *, renormalize: bool | None = None, shared: bool = False,
           expert_size: int | None = None) -> MoeConfig:
    """`renormalize` None = the config's norm_topk_prob; `expert_size` None = moe_intermediate_size."""
    n = hf_config.num_hidden_layers
    experts = int(getattr(hf_config, "num_local_experts", None) or hf_config.num_experts)
    norm = bool(getattr(hf_config, "norm_topk_prob", False)) if renormalize is None else renormalize
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
    shared_size = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0) if shared else 0
    return MoeConfig(
        route=RouteSpec(experts, int(hf_config.num_experts_per_tok), renormalize=norm),
        intermediate_size=int(expert_size if expert_size is not None else hf_config.moe_intermediate_size),
        sparse_layers=sparse_layers(n, step, dense),
        shared_intermediate_size=shared_size,
        shared_gate=shared_size > 0,
    )
