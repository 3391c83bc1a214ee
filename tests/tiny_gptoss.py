"""A tiny random HF gpt-oss (offline, no hub), every feature made to matter at its size.

    make_gptoss_model(tmp_path, **overrides) -> Path

Eight experts, top-2; layer 0 slides (an 8-token window, shorter than every test prompt), layer 1 attends fully;
YaRN over a 64-token original context (factor 8, truncate False), so the test positions see interpolated
frequencies; swiglu_limit 1.0 (the released 7.0 would never clamp activations of this size); sinks around 3 +- 2, large
enough to take weight from a prompt's keys (HF's init, std 0.08, would leave them invisible); a wide router with
a bias.
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

WINDOW = 8
GPTOSS: dict[str, Any] = {
    "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 96, "head_dim": 64,
    "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
}


def gptoss_hf_config(**overrides: Any) -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(**{**_BASE, "vocab_size": len(tiny_vocab()[0]), **GPTOSS, **overrides})


def make_gptoss_model(tmp_path: str | Path, **overrides: Any) -> Path:
    seed = overrides.pop("seed", 0)
    name = overrides.pop("name", "tiny-gpt-oss")

    def router_biases_sinks(model: Any, g: torch.Generator) -> None:
        for pname, p in model.named_parameters():
            if pname.endswith("mlp.router.weight"):
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif pname.endswith(("mlp.router.bias", "_proj_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif pname.endswith("self_attn.sinks"):
                p.copy_(3.0 + 2.0 * torch.randn(p.shape, generator=g))

    return save_random_model(tmp_path, name, gptoss_hf_config(**overrides), seed, router_biases_sinks)
