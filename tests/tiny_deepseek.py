"""Tiny random DeepSeek-V2 / V3 HF folders (multi-head latent attention, dense first layers, routed + shared experts).

    make_deepseek_model(tmp_path, "deepseek_v3", **overrides) -> Path
    DEEPSEEK_VARIANTS   # name -> (family, overrides): q_lora_rank set for V2, None for V3; more experts than top-k

Same tokenizer, weight perturbation and generation config as tiny_families. The latent row is 48 + 16 = 64 wide (a
power of two, so the Triton kernels take it too).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tiny_models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    save_random_model,
    tiny_vocab,
)

_BASE: dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.08,
    "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}

DEEPSEEK_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # low-rank q; group-limited greedy top-2 of 8 (4 groups, best 2) with softmax scores and a scaling factor
    "deepseek_v2": ("deepseek_v2", {"q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 4,
                                    "topk_group": 2, "routed_scaling_factor": 1.5, "n_shared_experts": 2}),
    # one q_proj; sigmoid scores + correction bias, grouped top-2 of 8 (4 groups, best 2), renormalised, scaled
    "deepseek_v3": ("deepseek_v3", {"q_lora_rank": None, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                                    "routed_scaling_factor": 2.5}),
}


def deepseek_hf_config(family: str, **overrides: Any) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    classes = {"deepseek_v2": DeepseekV2Config, "deepseek_v3": DeepseekV3Config}
    if family not in classes:
        raise ValueError(f"unknown tiny DeepSeek family {family!r}; choose from {sorted(classes)}")
    return classes[family](**{**_BASE, "vocab_size": len(tiny_vocab()[0]), **overrides})


def make_deepseek_model(tmp_path: str | Path, family: str, **overrides: Any) -> Path:
    """Build, randomise (norms around 1, biases and V3's correction bias around 0) and save a tiny model folder."""
    seed = overrides.pop("seed", 0)
    name = overrides.pop("name", f"tiny-{family}")

    def correction_bias(model: Any, g: torch.Generator) -> None:
        for mname, buf in model.named_buffers():
            if mname.endswith("e_score_correction_bias"):  # zero at init: the bias would go untested
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))

    return save_random_model(tmp_path, name, deepseek_hf_config(family, **overrides), seed, correction_bias)
