"""OLMoE: OLMo's qk-norm over the whole q / k projection (Llama's pre-norms otherwise), a MoE MLP on every layer
(softmax top-k, renormalised when norm_topk_prob)."""

from __future__ import annotations

from typing import Any

from ironlm.exceptions import UnsupportedModelError
from ironlm.model.families.moe_common import hf_moe
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    if getattr(hf_config, "clip_qkv", None) is not None:
        raise UnsupportedModelError("OLMoE with clip_qkv is not supported")
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {"attention_bias": bias, "attention_out_bias": bias, "qk_norm": True, "qk_norm_full": True,
            "moe": hf_moe(hf_config, expert_size=hf_config.intermediate_size)}


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    return {"qk_norm_full": True}


OLMOE = register(Family(
    name="olmoe",
    hf_classes=("OlmoeForCausalLM",),
    model_types=("olmoe",),
    gguf_archs=("olmoe",),
    features=("mixture of experts: softmax top-k (norm_topk_prob)", "qk-norm over the whole projection"),
    hf_fields=_hf,
    gguf_fields=_gguf,
))
