"""Qwen3-MoE (Qwen3-30B-A3B, ...): Qwen3's attention (per-head qk-norm), a MoE MLP (softmax top-k, renormalised
when norm_topk_prob), dense MLP layers where decoder_sparse_step / mlp_only_layers say."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import qwen_window
from ironlm.model.families.moe_common import hf_moe
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {"attention_bias": bias, "attention_out_bias": bias, "qk_norm": True, "moe": hf_moe(hf_config),
            **qwen_window(hf_config)}


QWEN3_MOE = register(Family(
    name="qwen3_moe",
    hf_classes=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    gguf_archs=("qwen3moe",),
    features=("mixture of experts: softmax top-k (norm_topk_prob)",
              "dense layers (decoder_sparse_step, mlp_only_layers)", "qk-norm"),
    hf_fields=_hf,
))
