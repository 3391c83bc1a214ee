"""Tiny random HF mixture-of-experts models (offline, no hub): Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

    make_moe_model(tmp_path, family, **overrides) -> Path    # like tiny_families.make_family_model
    MOE_VARIANTS                                             # every MoE feature of each family switched on

Eight experts, top-2 (OLMoE top-3), so most experts sit out each token; Qwen2-MoE has a gated shared expert and
a dense layer (mlp_only_layers), Qwen3-MoE a dense layer through decoder_sparse_step and renormalised weights.
The router is drawn wider than HF's init (std 2 / sqrt(hidden) = 0.125 per weight here, HF's 0.08) so tokens
spread over experts and the combine weights differ clearly (a near-uniform router would hide a routing bug).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiny_families import _BASE
from tiny_models import (
    save_random_model,
    tiny_vocab,
)

MOE_VARIANTS: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128},
    "qwen2_moe": {"num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                  "shared_expert_intermediate_size": 160, "mlp_only_layers": [1], "norm_topk_prob": False,
                  "qkv_bias": True},
    "qwen3_moe": {"num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                  "decoder_sparse_step": 2, "norm_topk_prob": True, "head_dim": 64},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 3, "intermediate_size": 96, "norm_topk_prob": False},
}


def moe_hf_config(family: str, **overrides: Any) -> Any:
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    classes = {"mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig,
               "olmoe": OlmoeConfig}
    if family not in classes:
        raise ValueError(f"unknown tiny MoE family {family!r}; choose from {sorted(classes)}")
    kwargs = {**_BASE, "vocab_size": len(tiny_vocab()[0]), **MOE_VARIANTS[family], **overrides}
    return classes[family](**kwargs)


def make_moe_model(tmp_path: str | Path, family: str, **overrides: Any) -> Path:
    """Build, randomise (wide router, norms around 1, biases around 0) and save a tiny `family` MoE folder."""
    seed = overrides.pop("seed", 0)
    name = overrides.pop("name", f"tiny-{family}")

    def wide_router(model: Any, g: torch.Generator) -> None:
        for pname, p in model.named_parameters():
            if pname.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    return save_random_model(tmp_path, name, moe_hf_config(family, **overrides), seed, wide_router)
