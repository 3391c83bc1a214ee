"""Llama (and the Llama-shaped checkpoints that say model_type llama: SmolLM2, TinyLlama, ...)."""

from __future__ import annotations

from typing import Any

from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return {"attention_bias": bias, "attention_out_bias": bias}


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    # llama.cpp writes Mistral's checkpoints as arch llama; transformers calls them mistral (same math)
    return {"architecture": "mistral"} if "mistral" in str(gf.get("general.name", "") or "").lower() else {}


LLAMA = register(Family(
    name="llama",
    hf_classes=("LlamaForCausalLM",),
    model_types=("llama",),
    gguf_archs=("llama",),
    features=("q/k/v/o biases (attention_bias)", "rope scaling linear / llama3 / yarn"),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
))
