"""`ModelConfig`: the architecture description the decoder is built from (from an HF config or GGUF metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ironlm.exceptions import UnsupportedModelError
from ironlm.model import registry
from ironlm.model.moe.spec import MoeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


# model_type -> HF class of every registered family (importing the registry's families registers them all)
SUPPORTED_ARCHITECTURES: dict[str, str] = registry.supported_model_types()


def unsupported_architecture(what: str) -> UnsupportedModelError:
    return registry.unsupported(what)


@dataclass
class ModelConfig:
    architecture: str  # a registered HF model_type (see registry.py)
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
    # ---- what families add to a Llama block (see registry.py; defaults = Llama) ---------------------------
    norm_offset: float = 0.0  # RMSNorm scales by (offset + w) (Gemma: 1); HF weights get it added at load
    activation: str = "silu"  # gated MLP activation: silu | gelu_tanh
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5
    attn_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_softcap: float | None = None  # the LM head's logits, likewise
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    residual_scale: float | None = None  # each block's branch output multiplied by this before the residual add
    logit_scale: float | None = None  # the LM head's logits divided by this (before soft-capping)
    pre_attn_norm: bool = True  # input_layernorm
    post_attn_norm: bool = False  # a norm on the attention output before the residual add
    pre_mlp_norm: bool = True  # post_attention_layernorm in Llama's naming
    post_mlp_norm: bool = False  # a norm on the MLP output before the residual add
    local_rope: dict[str, Any] | None = None  # rope_theta (+ scaling) of the sliding layers when it differs
    rotary_dim: int | None = None  # rotate only the first rotary_dim dims of each head; None = all
    rope_layers: list[bool] | None = None  # per layer: False = no positional encoding (NoPE); None = all rotate
    qk_norm_full: bool = False  # with qk_norm: one RMSNorm over the whole q (k) projection, not per head (OLMo 2)
    # ---- multi-head latent attention (DeepSeek-V2/V3; model/mla.py) ----------------------------------------
    # With kv_lora_rank set a layer caches ONE row per token: the normed kv_lora_rank latent and the
    # qk_rope_head_dim rotary key all heads share. The pool, the tier and the backends see it as a single KV head
    # of that width: the family sets num_kv_heads = 1, head_dim = kv_lora_rank + qk_rope_head_dim,
    # rotary_dim = qk_rope_head_dim and attn_scale (heads attend with qk_nope_head_dim + qk_rope_head_dim dims).
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # q through a low-rank a/b pair with a norm between; None = one q_proj
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint rotates interleaved pairs (x0, x1), ...: de-interleaved at load
    moe: MoeConfig | None = None  # mixture-of-experts MLPs on the layers it marks (see model/moe/)
    attn_sinks: bool = False  # a learned logit per query head joins each softmax's denominator (gpt-oss)
    # gpt-oss's experts: (alpha, limit) of (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    swiglu_clamp: tuple[float, float] | None = None
    source: str = "hf"  # hf | gguf
    hf_config: Any = field(default=None, repr=False, compare=False)  # the transformers config, when there is one

    def __post_init__(self) -> None:
        family = registry.by_model_type(self.architecture)
        if self.activation not in family.activations:
            raise UnsupportedModelError(
                f"unsupported hidden_act {self.activation!r} for {family.name} (supported: {', '.join(family.activations)})")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise UnsupportedModelError(f"rope_layers has {len(self.rope_layers)} entries for {self.num_layers} layers")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise UnsupportedModelError(f"rotary_dim must be even and in 1..head_dim, got {self.rotary_dim}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise UnsupportedModelError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError(
                f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise UnsupportedModelError(
                f"moe.sparse_layers has {len(self.moe.sparse_layers)} entries for {self.num_layers} layers")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.mla and (int(self.kv_lora_rank or 0) < 1 or self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2
                         or self.v_head_dim < 1 or self.qk_nope_head_dim < 0):
            raise UnsupportedModelError(
                f"latent attention needs kv_lora_rank >= 1, an even qk_rope_head_dim and v_head_dim >= 1, got "
                f"{self.kv_lora_rank}, {self.qk_rope_head_dim}, {self.v_head_dim}")
        for scaling in (self.rope_scaling, self.local_rope):
            rope_type = (scaling or {}).get("rope_type", "default")
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
    def mla(self) -> bool:
        """Multi-head latent attention: one latent row per token in the cache (see kv_lora_rank)."""
        return self.kv_lora_rank is not None

    @property
    def attn_out_size(self) -> int:
        """Width of the attention output that o_proj takes."""
        return self.num_heads * self.v_head_dim if self.mla else self.q_size

    @property
    def kv_planes(self) -> int:
        """Cache tensors per layer: K and V, or one for latent attention (its rows are both key and value)."""
        return 1 if self.mla else 2

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

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def lean_supported(self) -> bool:
        """Whether the lean CPU decode step (lean.py) implements this block: every norm placement, qk-norm (per
        head or over the whole projection), SiLU or GELU-tanh MLPs, attention scale and soft-cap, windows, a RoPE
        base per layer kind, NoPE layers, embedding and residual scales, sparse MoE layers (their block's own
        call); not partial rotary. A new field that lean.py does not implement must make this False (latent
        attention, attention sinks, a clamped SwiGLU)."""
        return (self.rotary_dim is None and self.activation in ("silu", "gelu_tanh")
                and not self.mla and not self.attn_sinks and self.swiglu_clamp is None)

    def rotary_config(self, layer: int) -> ModelConfig:
        """The config whose rope fields give layer `layer`'s rotary (the sliding layers' own base, if any)."""
        if self.local_rope is None or self.layer_windows[layer] is None:
            return self
        local = dict(self.local_rope)
        theta = float(local.pop("rope_theta", self.rope_theta))
        kind = local.get("rope_type", "default")
        return replace(self, rope_theta=theta, rope_scaling=None if kind == "default" else local, local_rope=None)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (and V) cache tensor."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """K + V bytes one token occupies over all layers (the latent row for latent attention)."""
        return self.kv_planes * self.num_layers * self.kv_size * dtype_size

    def mha_kv_bytes_per_token(self, dtype_size: int) -> int:
        """What one token would occupy with ordinary per-head K and V: for latent attention, every head's expanded
        key (qk_nope_head_dim + qk_rope_head_dim) and value (v_head_dim), as an engine without MLA caches them."""
        if not self.mla:
            return self.kv_bytes_per_token(dtype_size)
        per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return self.num_layers * self.num_heads * per_head * dtype_size

    def num_parameters(self) -> int:
        h, i, n = self.hidden_size, self.intermediate_size, self.num_layers
        norms = self.pre_attn_norm + self.post_attn_norm + self.pre_mlp_norm + self.post_mlp_norm
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + norms * h
        per_layer += (self.q_size + 2 * self.kv_size) * self.attention_bias + h * self.attention_out_bias
        per_layer += (self.q_size + self.kv_size if self.qk_norm_full else 2 * self.head_dim) * self.qk_norm
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        total = n * (per_layer + self.num_heads * self.attn_sinks) + emb + h
        if self.moe is not None:  # a MoE layer's MLP: router, every expert, the shared expert (not the dense MLP)
            m = self.moe
            moe_mlp = h * m.num_experts + 3 * h * (m.num_experts * m.intermediate_size + m.shared_intermediate_size)
            moe_mlp += h * m.shared_gate + m.num_experts * m.router_bias
            moe_mlp += m.num_experts * (2 * m.intermediate_size + h) * m.expert_bias
            total += sum(m.sparse_layers) * (moe_mlp - 3 * h * i)
        return total

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_config: Any, generation_config: Any = None) -> ModelConfig:
        """Build from a `transformers` config (and optional `GenerationConfig` for eos ids): the fields every
        family reads alike, then the family's own (`Family.hf_fields`)."""
        model_type = getattr(hf_config, "model_type", None)
        archs = getattr(hf_config, "architectures", None) or []
        family = registry.by_model_type(model_type, f"{'/'.join(map(str, archs or [model_type]))} "
                                                    f"(model_type={model_type!r})")
        act = getattr(hf_config, "hidden_act", "silu")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        num_heads = hf_config.num_attention_heads
        num_kv = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads

        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        rope_theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        partial = float(rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None) or 1.0))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        num_labels = int(hf_config.num_labels) if archs and str(archs[0]).endswith("ForSequenceClassification") else None

        eos: list[int] = []
        for src in (generation_config, hf_config):
            value = getattr(src, "eos_token_id", None) if src is not None else None
            for t in [value] if isinstance(value, int) else (value or []):
                if t is not None and int(t) not in eos:
                    eos.append(int(t))

        fields: dict[str, Any] = dict(  # noqa: C408 - keyword form, as the dataclass call it feeds
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
            activation=registry.ACTIVATIONS.get(act, act),
            eos_token_ids=eos,
            bos_token_id=_first(getattr(generation_config, "bos_token_id", None))
            if generation_config is not None and getattr(generation_config, "bos_token_id", None) is not None
            else _first(getattr(hf_config, "bos_token_id", None)),
            pad_token_id=_first(getattr(hf_config, "pad_token_id", None)),
            num_labels=num_labels,
            source="hf",
            hf_config=hf_config,
        )
        fields.update(family.hf_fields(hf_config))
        if partial != 1.0 and fields.get("rotary_dim") is None:  # a family that rotates part of a head says so
            raise UnsupportedModelError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not "
                                        f"supported for {family.name}")
        return cls(**fields)


def _first(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)
