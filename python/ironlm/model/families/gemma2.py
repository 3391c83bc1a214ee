"""Gemma 2: GeGLU (gelu_pytorch_tanh), ``1 + w`` RMSNorms, a norm after attention and after the MLP as well as
before each, embeddings scaled by sqrt(hidden), ``query_pre_attn_scalar ** -0.5`` attention scale, tanh
soft-capping of the attention logits and of the final logits, sliding windows on every other layer."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import layer_types_window, optional_float
from ironlm.model.registry import ACTIVATIONS, Family, register

# Gemma names its four block norms for where they sit; ironlm's pre-MLP norm keeps Llama's name.
GEMMA_RENAMES = {
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}


def gemma_fields(hf_config: Any) -> dict[str, Any]:
    """What Gemma 2 and 3 share."""
    act = str(getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "gelu_pytorch_tanh"))
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {
        "norm_offset": 1.0,
        "activation": ACTIVATIONS.get(act, act),
        "attn_scale": None if scalar is None else float(scalar) ** -0.5,
        "embed_scale": float(hf_config.hidden_size) ** 0.5,
        "post_attn_norm": True,
        "post_mlp_norm": True,
        "attention_bias": bias,
        "attention_out_bias": bias,
        "attn_softcap": optional_float(getattr(hf_config, "attn_logit_softcapping", None)),
        "final_softcap": optional_float(getattr(hf_config, "final_logit_softcapping", None)),
        **layer_types_window(hf_config),
    }


def gemma_gguf_fields(meta: Any, gf: Any, period: int) -> dict[str, Any]:
    """llama.cpp's converter stores the norms as ``1 + w`` already, and keeps no query_pre_attn_scalar (its graph
    scales by head_dim ** -0.5); every `period`-th layer is global, as llama.cpp's swa pattern."""
    n = int(meta("block_count"))
    window = meta("attention.sliding_window")
    return {
        "activation": "gelu_tanh",
        "embed_scale": float(meta("embedding_length")) ** 0.5,
        "post_attn_norm": True,
        "post_mlp_norm": True,
        "attn_softcap": optional_float(meta("attn_logit_softcapping")),
        "final_softcap": optional_float(meta("final_logit_softcapping")),
        "sliding_window": None if window is None else int(window),
        "sliding_layers": None if window is None else [(i + 1) % period != 0 for i in range(n)],
    }


GEMMA2 = register(Family(
    name="gemma2",
    hf_classes=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    gguf_archs=("gemma2",),
    features=("GeGLU (gelu tanh)", "1+w RMSNorm", "post-attention / post-feedforward norms",
              "embedding x sqrt(hidden)", "query_pre_attn_scalar", "attention logit soft-capping",
              "final logit soft-capping", "alternating local / global sliding windows", "tied head"),
    activations=("gelu_tanh",),
    hf_fields=gemma_fields,
    gguf_fields=lambda meta, gf: gemma_gguf_fields(meta, gf, 2),
    hf_renames=GEMMA_RENAMES,
))
