"""What several families read from their HF configs (or GGUF metadata) the same way."""

from __future__ import annotations

from typing import Any

from ironlm.exceptions import UnsupportedModelError


def layer_types_window(hf_config: Any) -> dict[str, Any]:
    """`sliding_window` / `sliding_layers` from transformers' `layer_types` ("sliding_attention" layers slide)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if not window or types is None:
        return {}
    flags = [t == "sliding_attention" for t in types]
    return {"sliding_window": int(window), "sliding_layers": flags} if any(flags) else {}


def qwen_window(hf_config: Any) -> dict[str, Any]:
    """Qwen2/Qwen3: configs keep `sliding_window` even when `use_sliding_window` is off; without `layer_types`,
    layers from `max_window_layers` on slide (transformers' rule)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return {}
    if getattr(hf_config, "layer_types", None) is not None:
        return layer_types_window(hf_config)
    n = hf_config.num_hidden_layers
    first = getattr(hf_config, "max_window_layers", n)
    flags = [i >= first for i in range(n)]
    return {"sliding_window": int(window), "sliding_layers": flags} if any(flags) else {}


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def gguf_rope_scaling(meta: Any) -> dict[str, Any] | None:
    """The file's RoPE scaling in transformers' ``rope_parameters`` terms (linear, yarn), None without one."""
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
    orig = meta("rope.scaling.original_context_length")
    if orig is None:
        raise UnsupportedModelError("GGUF yarn rope scaling without rope.scaling.original_context_length")
    keys = {"beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "attention_factor": "yarn_attn_factor"}
    extra = {k: float(meta(f"rope.scaling.{v}")) for k, v in keys.items() if meta(f"rope.scaling.{v}") is not None}
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(orig), **extra}
