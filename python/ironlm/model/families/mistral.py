"""Mistral: Llama's block with a sliding window on every layer (MistralModel ignores layer_types)."""

from __future__ import annotations

from typing import Any

from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    window = getattr(hf_config, "sliding_window", None)
    return {"sliding_window": int(window)} if window else {}


MISTRAL = register(Family(
    name="mistral",
    hf_classes=("MistralForCausalLM",),
    model_types=("mistral",),
    gguf_archs=("mistral",),
    features=("sliding window on every layer",),
    hf_fields=_hf,
    gguf_permuted_qk=True,
))
