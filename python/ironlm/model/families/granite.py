"""Granite (GraniteForCausalLM): Llama's block with four scalars: embeddings x embedding_multiplier, each branch
x residual_multiplier before its residual add, attention_multiplier as the softmax scale, logits / logits_scaling."""

from __future__ import annotations

from typing import Any

from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "embed_scale": float(hf_config.embedding_multiplier),
        "residual_scale": float(hf_config.residual_multiplier),
        "attn_scale": float(hf_config.attention_multiplier),
        "logit_scale": float(hf_config.logits_scaling),
    }


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    # The converter writes each only when the HF config's value is truthy; absent = transformers' default 1.0
    return {
        "embed_scale": float(meta("embedding_scale", 1.0)),
        "residual_scale": float(meta("residual_scale", 1.0)),
        "attn_scale": float(meta("attention.scale", 1.0)),
        "logit_scale": float(meta("logit_scale", 1.0)),
    }


GRANITE = register(Family(
    name="granite",
    hf_classes=("GraniteForCausalLM",),
    model_types=("granite",),
    gguf_archs=("granite",),
    features=("embedding_multiplier", "residual_multiplier", "attention_multiplier (softmax scale)",
              "logits_scaling", "q/k/v/o biases (attention_bias)"),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
))
