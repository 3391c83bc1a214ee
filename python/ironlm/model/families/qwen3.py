"""Qwen3: per-head RMSNorm on q and k before RoPE, optional biases and sliding windows."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import qwen_window
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {"attention_bias": bias, "attention_out_bias": bias, "qk_norm": True, **qwen_window(hf_config)}


QWEN3 = register(Family(
    name="qwen3",
    hf_classes=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    gguf_archs=("qwen3",),
    features=("qk-norm", "q/k/v/o biases (attention_bias)", "sliding window from layer_types"),
    hf_fields=_hf,
))
