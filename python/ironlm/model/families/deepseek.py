"""DeepSeek-V2 / DeepSeek-V3 (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM): multi-head latent attention
(model/mla.py) on every layer, optionally a low-rank q (q_lora_rank), RoPE on interleaved pairs, YaRN's mscale in
the softmax scale; dense MLPs on the first `first_k_dense_replace` layers."""

from __future__ import annotations

import math
from typing import Any

from ironlm.exceptions import UnsupportedModelError
from ironlm.model.registry import Family, register


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla_fields(hf: Any, interleave: bool) -> dict[str, Any]:
    rank, rope = int(hf.kv_lora_rank), int(hf.qk_rope_head_dim)
    nope, v_dim = int(hf.qk_nope_head_dim), int(hf.v_head_dim)
    scale = (nope + rope) ** -0.5
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type", "default")) not in (None, "default") and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m  # transformers' yarn_apply_mscale: the attention logits, not only the rotary
    q_rank = getattr(hf, "q_lora_rank", None)
    bias = bool(getattr(hf, "attention_bias", False))
    first_dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    if first_dense < hf.num_hidden_layers:
        raise UnsupportedModelError(
            f"{hf.model_type}: mixture-of-experts layers (from layer {first_dense} on) are not supported yet")
    return {
        "kv_lora_rank": rank, "q_lora_rank": None if q_rank is None else int(q_rank), "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope, "v_head_dim": v_dim, "rope_interleave": interleave,
        # the cache's one latent "head" (see ModelConfig.kv_lora_rank)
        "num_kv_heads": 1, "head_dim": rank + rope, "rotary_dim": rope, "attn_scale": scale,
        "attention_bias": bias, "attention_out_bias": bias,
    }


def _v2(hf: Any) -> dict[str, Any]:
    return _mla_fields(hf, interleave=True)  # transformers rotates V2's q_pe / k_pe as complex pairs


def _v3(hf: Any) -> dict[str, Any]:
    return _mla_fields(hf, interleave=bool(getattr(hf, "rope_interleave", True)))


_FEATURES = ("multi-head latent attention (latent KV cache, absorbed up-projections)", "low-rank q (q_lora_rank)",
             "dense first layers (first_k_dense_replace)")

DEEPSEEK_V2 = register(Family(
    name="deepseek_v2",
    hf_classes=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    features=_FEATURES,
    hf_fields=_v2,
))

DEEPSEEK_V3 = register(Family(
    name="deepseek_v3",
    hf_classes=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    features=_FEATURES,
    hf_fields=_v3,
))
