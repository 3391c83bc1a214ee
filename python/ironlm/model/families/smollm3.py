"""SmolLM3 (SmolLM3ForCausalLM): Llama's block with NoPE layers (no rotary at all; `no_rope_layers[i] == 0`, by
default every 4th layer) and an optional sliding window on the NoPE layers."""

from __future__ import annotations

from typing import Any

from ironlm.model.families.common import layer_types_window
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    bias = bool(getattr(hf_config, "attention_bias", False))
    flags = [bool(x) for x in hf_config.no_rope_layers]
    fields: dict[str, Any] = {"attention_bias": bias, "attention_out_bias": bias,
                              "rope_layers": None if all(flags) else flags}
    if getattr(hf_config, "use_sliding_window", False):
        fields.update(layer_types_window(hf_config))
    return fields


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    # The converter writes no NoPE pattern: llama.cpp hard-codes every 4th layer (n_no_rope_layer_step = 4)
    flags = [(i + 1) % 4 != 0 for i in range(int(meta("block_count")))]
    return {"rope_layers": None if all(flags) else flags}


SMOLLM3 = register(Family(
    name="smollm3",
    hf_classes=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    gguf_archs=("smollm3",),
    features=("NoPE layers (no_rope_layers; every 4th in GGUF)", "sliding window on NoPE layers",
              "q/k/v/o biases (attention_bias)"),
    hf_fields=_hf,
    gguf_fields=_gguf,
    gguf_permuted_qk=True,
))
