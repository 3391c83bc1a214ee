"""Phi-3 / Phi-4 (Phi3ForCausalLM): Llama's block with q|k|v and gate|up fused in the checkpoint (split on the way
in), LongRoPE ('su' / 'longrope': short and long per-frequency factors, a cos/sin scale), partial rotary
(Phi-4-mini rotates 3/4 of each head) and an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any

from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind in ("su", "longrope"):
        rope.setdefault("original_max_position_embeddings",
                        getattr(hf_config, "original_max_position_embeddings", None))
        fields["rope_scaling"] = {**rope, "rope_type": "longrope"}
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    partial = float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))
    if partial != 1.0:
        fields["rotary_dim"] = int(head_dim * partial)
    window = getattr(hf_config, "sliding_window", None)
    if window:
        fields["sliding_window"] = int(window)  # Phi3Attention passes it to every layer
    return fields


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    head_dim = int(meta("embedding_length")) // int(meta("attention.head_count"))
    rot = meta("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        fields["rotary_dim"] = int(rot)
    if "rope_factors_long.weight" in gf.tensors:
        fields["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": gf.dequantize("rope_factors_long.weight").float().flatten().tolist(),
            "short_factor": gf.dequantize("rope_factors_short.weight").float().flatten().tolist(),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "attention_factor": float(meta("rope.scaling.attn_factor", 1.0)),
        }
    window = meta("attention.sliding_window")
    if window:  # the converter writes 0 for none
        fields["sliding_window"] = int(window)
    return fields


def _split(cfg: Any, name: str, tensor: Any) -> list[tuple[str, Any]] | None:
    """qkv_proj rows are q|k|v and gate_up_proj rows gate|up (Phi3MLP chunks gate first)."""
    if name.endswith(".self_attn.qkv_proj.weight"):
        p = name[: -len("qkv_proj.weight")]
        q, kv = cfg.q_size, cfg.kv_size
        return [(p + "q_proj.weight", tensor[:q]), (p + "k_proj.weight", tensor[q : q + kv]),
                (p + "v_proj.weight", tensor[q + kv : q + 2 * kv])]
    if name.endswith(".mlp.gate_up_proj.weight"):
        p, inter = name[: -len("gate_up_proj.weight")], cfg.intermediate_size
        return [(p + "gate_proj.weight", tensor[:inter]), (p + "up_proj.weight", tensor[inter : 2 * inter])]
    return None


PHI3 = register(Family(
    name="phi3",
    hf_classes=("Phi3ForCausalLM",),
    model_types=("phi3",),
    gguf_archs=("phi3",),
    features=("fused qkv_proj / gate_up_proj", "LongRoPE (su / longrope)", "partial rotary (partial_rotary_factor)",
              "sliding window on every layer"),
    hf_fields=_hf,
    gguf_fields=_gguf,
    split=_split,
))
