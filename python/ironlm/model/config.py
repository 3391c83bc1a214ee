"""`ModelConfig`: the architecture description the decoder is built from (from an HF config or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ironlm.exceptions import UnsupportedModelError

# model_type -> the HF class it corresponds to. Everything else is rejected at load time.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_architecture(what: str) -> UnsupportedModelError:
    names = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_ARCHITECTURES.items())
    return UnsupportedModelError(f"unsupported model architecture {what}; ironlm supports: {names}")


@dataclass
class ModelConfig:
    architecture: str  # model_type: llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None or the HF rope dict, e.g. {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, ...}
    rope_scaling: dict[str, Any] | None = None
    # llama.cpp's per-frequency divisors (GGUF tensor rope_freqs.weight, llama3-style scaling); len head_dim/2
    rope_freq_factors: list[float] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, Llamas with attention_bias)
    attention_out_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 attention_bias; never Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rotary (Qwen3)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # Sliding-window attention, when the checkpoint really uses it: a query at position p attends keys in
    # (p - sliding_window, p] (transformers' convention), on the layers `sliding_layers` marks (None = every layer).
    sliding_window: int | None = None
    sliding_layers: list[bool] | None = None
    # Labels of a *ForSequenceClassification checkpoint, whose `score.weight` [num_labels, hidden] replaces the LM
    # head (a reranker's relevance head); None for causal LMs.
    num_labels: int | None = None
    source: str = "hf"  # hf | gguf
    hf_config: Any = field(default=None, repr=False, compare=False)  # the transformers config, when there is one

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported_architecture(repr(self.architecture))
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise UnsupportedModelError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError(
                f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """The model's native context length (sliding-window layers attend inside their window past it too)."""
        return self.max_position_embeddings

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer: the attention window in tokens, or None for full causal attention."""
        if not self.sliding_window:
            return [None] * self.num_layers
        flags = self.sliding_layers if self.sliding_layers is not None else [True] * self.num_layers
        return [int(self.sliding_window) if f else None for f in flags]

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (and V) cache tensor."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """K + V bytes one token occupies over all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_size

    def num_parameters(self) -> int:
        h, i, n = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        per_layer += (self.q_size + 2 * self.kv_size) * self.attention_bias + h * self.attention_out_bias
        per_layer += 2 * self.head_dim * self.qk_norm
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n * per_layer + emb + h

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> ModelConfig:
        """Build from a `transformers` config (and optional `GenerationConfig` for eos ids)."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_ARCHITECTURES:
            archs = getattr(hf_config, "architectures", None) or [model_type]
            raise unsupported_architecture(f"{'/'.join(map(str, archs))} (model_type={model_type!r})")
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} (only silu)")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        num_heads = hf_config.num_attention_heads
        num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads

        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}

        if model_type == "qwen2":
            attention_bias = True
        else:
            attention_bias = bool(getattr(hf_config, "attention_bias", False))

        sliding, sliding_layers = _sliding_window(hf_config, model_type)
        archs = getattr(hf_config, "architectures", None) or []
        num_labels = int(hf_config.num_labels) if archs and str(archs[0]).endswith("ForSequenceClassification") else None

        eos: list[int] = []
        for src in (generation_config, hf_config):
            value = getattr(src, "eos_token_id", None) if src is not None else None
            for t in [value] if isinstance(value, int) else (value or []):
                if t is not None and int(t) not in eos:
                    eos.append(int(t))

        return cls(
            architecture=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096) or 4096,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            # A classifier's score head is its own tensor even where the base model ties its LM head.
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)) and num_labels is None,
            attention_bias=attention_bias,
            attention_out_bias=attention_bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos,
            bos_token_id=_first(getattr(generation_config, "bos_token_id", None))
            if generation_config is not None and getattr(generation_config, "bos_token_id", None) is not None
            else _first(getattr(hf_config, "bos_token_id", None)),
            pad_token_id=_first(getattr(hf_config, "pad_token_id", None)),
            sliding_window=sliding,
            sliding_layers=sliding_layers,
            num_labels=num_labels,
            source="hf",
            hf_config=hf_config,
        )


def _first(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _sliding_window(hf_config: Any, model_type: str) -> tuple[int | None, list[bool] | None]:
    """(window, per-layer flags) as transformers' modeling code applies them; (None, None) without a window."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None, None
    if model_type == "mistral":  # MistralModel applies the window on every layer and ignores layer_types
        return int(window), None
    if model_type == "llama":
        return None, None
    # Qwen2/Qwen3: configs keep `sliding_window` even when `use_sliding_window` is off
    if not getattr(hf_config, "use_sliding_window", True):
        return None, None
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is not None:
        flags = [t == "sliding_attention" for t in types]
    else:  # transformers' rule when layer_types is absent: layers from max_window_layers on slide
        first = getattr(hf_config, "max_window_layers", n)
        flags = [i >= first for i in range(n)]
    if not any(flags):
        return None, None
    return int(window), flags
