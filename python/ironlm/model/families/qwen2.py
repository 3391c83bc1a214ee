"""Qwen2 / Qwen2.5: q/k/v biases (never on o), optional sliding windows on the upper layers."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import qwen_window
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    return {"attention_bias": True, "attention_out_bias": False, **qwen_window(hf_config)}


QWEN2 = register(Family(
    name="qwen2",
    hf_classes=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    gguf_archs=("qwen2",),
    features=("q/k/v biases", "sliding window from max_window_layers / layer_types"),
    hf_fields=_hf,
))
