"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2's block plus ``1 + w`` qk-norm, a RoPE base
of its own for the sliding (local) layers, five local layers to one global. Final-logit soft-capping where the
config sets it (released checkpoints set none); ``attn_logit_softcapping`` is ignored, as transformers' Gemma 3
attention ignores it."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.gemma2 import GEMMA_RENAMES, gemma_fields, gemma_gguf_fields
from ironlm.model.registry import Family, register


def _rope(params: dict[str, Any]) -> dict[str, Any]:
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return {**params, "rope_type": kind}


def _hf(hf_config: Any) -> dict[str, Any]:
    fields = {**gemma_fields(hf_config), "qk_norm": True, "attn_softcap": None}
    params = getattr(hf_config, "rope_parameters", None) or {}
    if "full_attention" in params:  # transformers >= 5: one rope dict per layer type
        full, local = _rope(params["full_attention"]), _rope(params.get("sliding_attention") or {})
        fields["rope_theta"] = float(full.get("rope_theta", 1_000_000.0))
        fields["rope_scaling"] = None if full["rope_type"] == "default" else full
    else:
        local = {"rope_type": "default", "rope_theta": getattr(hf_config, "rope_local_base_freq", 10_000.0)}
    fields["local_rope"] = {**local, "rope_theta": float(local.get("rope_theta", 10_000.0))}
    return fields


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    # llama.cpp runs the local layers at their own base (10000 unless the file says) without the global scaling
    theta = float(meta("rope.freq_base_swa", 10_000.0))
    return {**gemma_gguf_fields(meta, gf, 6), "qk_norm": True, "attn_softcap": None,
            "local_rope": {"rope_type": "default", "rope_theta": theta}}


GEMMA3 = register(Family(
    name="gemma3_text",
    hf_classes=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    gguf_archs=("gemma3",),
    features=("GeGLU (gelu tanh)", "1+w RMSNorm", "1+w qk-norm", "post-attention / post-feedforward norms",
              "embedding x sqrt(hidden)", "query_pre_attn_scalar", "5:1 local / global sliding windows",
              "local RoPE base (rope_local_base_freq)", "final logit soft-capping when configured", "tied head"),
    activations=("gelu_tanh",),
    hf_fields=_hf,
    gguf_fields=_gguf,
    hf_renames=GEMMA_RENAMES,
))
