"""Tiny random HF models of the families beyond Llama/Qwen: Phi-3, OLMo 2, SmolLM3, Granite (offline, no hub).

    make_family_model(tmp_path, family, **overrides) -> Path    # like tiny_models.make_tiny_model
    FAMILY_VARIANTS                                              # every feature of each family switched on

Same tokenizer (byte-level BPE, vocab = the model's), sizes and weight perturbation as tiny_models; overrides are
HF config fields plus seed / name. Phi-3 folders say tokenizer_class GPT2Tokenizer, as Phi-4's do: llama.cpp's
converter reads a Phi-3 vocabulary from tokenizer.model (sentencepiece) otherwise.
"""

from __future__ import annotations

import json
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
    "hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "initializer_range": 0.08, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def _factors(n: int, seed: int, spread: float) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + spread * torch.rand(n, generator=g)).tolist()


def longrope(rotary_dim: int, original: int, theta: float = 10000.0, partial: float = 1.0) -> dict[str, Any]:
    """LongRoPE parameters with random short (1..2) and long (1..4) factors for a `rotary_dim`-wide rotary."""
    return {"rope_type": "longrope", "rope_theta": theta, "partial_rotary_factor": partial,
            "short_factor": _factors(rotary_dim // 2, 1, 1.0), "long_factor": _factors(rotary_dim // 2, 2, 3.0),
            "original_max_position_embeddings": original}


FAMILY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # LongRoPE past a 16-token original context (every test prompt is longer: transformers uses the long factors
    # throughout, as ironlm does for a 512-token context), Phi-4-mini's partial rotary (3/4 of head_dim 64),
    # a 20-token window on every layer
    "phi3": ("phi3", {"rope_parameters": longrope(48, 16, partial=0.75), "original_max_position_embeddings": 16,
                      "sliding_window": 20}),
    # post-norms, full-width qk-norm, q/k/v/o biases
    "olmo2": ("olmo2", {"attention_bias": True}),
    # layer 1 is NoPE and slides (16-token window), layer 0 rotates with full attention; tied head
    "smollm3": ("smollm3", {"no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 16,
                            "tie_word_embeddings": True}),
    # all four multipliers (Granite-3-like magnitudes), biases, tied head
    "granite": ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                            "attention_multiplier": 0.0078125, "logits_scaling": 8.0, "attention_bias": True,
                            "tie_word_embeddings": True}),
}


def family_hf_config(family: str, **overrides: Any) -> Any:
    from transformers import GraniteConfig, Olmo2Config, Phi3Config, SmolLM3Config

    classes = {"phi3": Phi3Config, "olmo2": Olmo2Config, "smollm3": SmolLM3Config, "granite": GraniteConfig}
    if family not in classes:
        raise ValueError(f"unknown tiny family {family!r}; choose from {sorted(classes)}")
    kwargs = {**_BASE, "vocab_size": len(tiny_vocab()[0]), **overrides}
    return classes[family](**kwargs)


def make_family_model(tmp_path: str | Path, family: str, **overrides: Any) -> Path:
    """Build, randomise (norm weights around 1, biases around 0) and save a tiny `family` model folder."""
    seed = overrides.pop("seed", 0)
    name = overrides.pop("name", f"tiny-{family}")
    out = save_random_model(tmp_path, name, family_hf_config(family, **overrides), seed)
    if family == "phi3":
        path = out / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        path.write_text(json.dumps(cfg, indent=2))
    return out
