"""OLMo 2 (Olmo2ForCausalLM): no norm before attention or the MLP; a norm on each branch's output before its
residual add instead, and an RMSNorm over the whole q and k projections (not per head) before RoPE."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import layer_types_window
from ironlm.model.registry import Family, register

# OLMo 2's post_attention_layernorm is on the attention output (Llama's name means the norm before the MLP)
OLMO2_RENAMES = {
    "post_attention_layernorm.weight": "post_attn_norm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_norm.weight",
}
_NORMS = {"pre_attn_norm": False, "pre_mlp_norm": False, "post_attn_norm": True, "post_mlp_norm": True,
          "qk_norm": True, "qk_norm_full": True}


def _hf(hf_config: Any) -> dict[str, Any]:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {**_NORMS, "attention_bias": bias, "attention_out_bias": bias, **layer_types_window(hf_config)}


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    return dict(_NORMS)


OLMO2 = register(Family(
    name="olmo2",
    hf_classes=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    gguf_archs=("olmo2",),
    features=("post-attention / post-feedforward norms instead of pre-norms", "qk-norm over the full q/k width",
              "q/k/v/o biases (attention_bias)"),
    hf_fields=_hf,
    gguf_fields=_gguf,
    hf_renames=OLMO2_RENAMES,
))
