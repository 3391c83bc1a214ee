"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention (q/k/v biases), a MoE MLP with a shared expert gated by a sigmoid,
dense MLP layers where decoder_sparse_step / mlp_only_layers say."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import qwen_window
from ironlm.model.families.moe_common import hf_moe
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    return {"attention_bias": bool(getattr(hf_config, "qkv_bias", True)), "moe": hf_moe(hf_config, shared=True),
            **qwen_window(hf_config)}


QWEN2_MOE = register(Family(
    name="qwen2_moe",
    hf_classes=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    gguf_archs=("qwen2moe",),
    features=("mixture of experts: softmax top-k (norm_topk_prob)", "shared expert with a sigmoid gate",
              "dense layers (decoder_sparse_step, mlp_only_layers)", "q/k/v biases"),
    hf_fields=_hf,
))
