"""Checkpoint weights -> the decoder's parameters: which names a model needs, where each goes, GGUF names.

ironlm names weights as Llama's HF checkpoints do (``model.layers.N.self_attn.q_proj.weight``, ...) plus the two
norms Llama lacks: ``post_attn_norm.weight`` (on the attention output) and ``post_mlp_norm.weight`` (on the MLP
output); ``post_attention_layernorm.weight`` is always the norm *before* the MLP. A family whose checkpoints name
them otherwise renames (`Family.hf_renames`) or splits fused tensors (`Family.split`) on the way in; routed experts
stacked in one tensor per projection (transformers 5, gpt-oss) load through moe/stacked.py in every MoE family.
GGUF tensor names (llama.cpp's, one per slot whatever the family) map onto the same names.

Parameters are stored fused and transposed (see llama.py), so a projection's target is a transposed, possibly
strided view in the checkpoint's own [out, in] shape. A family's ``norm_offset`` (Gemma's ``1 + w``) is added to
every norm weight of an HF checkpoint as it is copied, computed in fp32 and rounded once into the model dtype:
exact in fp32, one rounding of ``1 + w`` in 16-bit dtypes (GGUF files hold the sum already).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ironlm.model import registry
from ironlm.model.mla import LatentAttention
from ironlm.model.moe import stacked

if TYPE_CHECKING:
    from ironlm.model.config import ModelConfig

LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def canonical(cfg: ModelConfig, name: str) -> str:
    """A checkpoint's HF name -> ironlm's name for the same weight (the family's renames applied)."""
    renames = registry.by_model_type(cfg.architecture).hf_renames
    if not renames:
        return name
    m = LAYER_RE.match(name)
    if m is None or m.group(2) not in renames:
        return name
    return f"model.layers.{m.group(1)}.{renames[m.group(2)]}"


def expected_weights(cfg: ModelConfig) -> list[str]:
    """ironlm names of the weights a checkpoint must provide."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("score.weight" if cfg.num_labels else "lm_head.weight")
    norms = [("input_layernorm", cfg.pre_attn_norm), ("post_attn_norm", cfg.post_attn_norm),
             ("post_attention_layernorm", cfg.pre_mlp_norm), ("post_mlp_norm", cfg.post_mlp_norm)]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"{n}.weight" for n, present in norms if present]
        if cfg.mla:
            names += [p + "self_attn." + n for n in LatentAttention.weight_names(cfg)]
            names.append(p + "self_attn.o_proj.weight")
        else:
            names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            names += moe_weights(cfg, p)
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if cfg.attention_bias and not cfg.mla:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.attention_out_bias:
            names.append(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if cfg.attn_sinks:
            names.append(p + "self_attn.sinks")
    return names


def moe_weights(cfg: ModelConfig, p: str) -> list[str]:
    """A MoE layer's MLP weights (prefix `p` = model.layers.N.): the router, each expert's projections, the shared
    expert and its gate, biases where the family has them."""
    m = cfg.moe
    assert m is not None
    experts = m.expert_range  # this rank's, under expert parallelism
    names = [p + "mlp.gate.weight"] + [p + f"mlp.experts.{e}.{x}_proj.weight" for e in experts
                                       for x in ("gate", "up", "down")]
    if m.router_bias:
        names.append(p + "mlp.gate.bias")
    if m.correction_bias:
        names.append(p + "mlp.gate.e_score_correction_bias")
    if m.expert_bias:
        names += [p + f"mlp.experts.{e}.{x}_proj.bias" for e in experts for x in ("gate", "up", "down")]
    if m.shared_intermediate_size:
        names += [p + f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")]
    if m.shared_gate:
        names.append(p + "mlp.shared_expert_gate.weight")
    return names


_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")


def moe_target(block: Any, rest: str) -> torch.Tensor | None:
    """The view of a MoeBlock parameter the layer-relative name `rest` goes into, in the checkpoint's shape; None
    for another rank's expert (expert parallelism), so loaders skip it unread."""
    inter = block.cfg.intermediate_size
    m = _EXPERT_RE.match(rest)
    if m is not None:
        e, x, kind = int(m.group(1)), m.group(2), m.group(3)
        if e not in block.cfg.expert_range:
            return None
        e -= block.first
        cols = {"gate": slice(0, inter), "up": slice(inter, 2 * inter)}
        if kind == "weight":
            return block.down_weight[e].t() if x == "down" else block.gate_up_weight[e][:, cols[x]].t()
        if block.gate_up_bias is None:
            return None
        return block.down_bias[e] if x == "down" else block.gate_up_bias[e][cols[x]]
    shared = block.cfg.shared_intermediate_size
    simple = {
        "mlp.gate.weight": block.router_weight.t(),
        "mlp.gate.bias": block.router_bias,
        "mlp.gate.e_score_correction_bias": block.correction,
        "mlp.shared_expert_gate.weight": None if block.shared_gate_weight is None else block.shared_gate_weight.t(),
    }
    if shared:
        simple.update({
            "mlp.shared_expert.gate_proj.weight": block.shared_gate_up_weight[:, :shared].t(),
            "mlp.shared_expert.up_proj.weight": block.shared_gate_up_weight[:, shared:].t(),
            "mlp.shared_expert.down_proj.weight": block.shared_down_weight.t(),
        })
    return simple.get(rest)


_ANY_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def foreign_expert(cfg: ModelConfig, name: str) -> bool:
    """Whether the checkpoint tensor `name` (any family's naming: mlp.experts.N., block_sparse_moe.experts.N.)
    is a routed expert another rank holds under expert parallelism: loaders skip it before reading its bytes."""
    if cfg.moe is None or cfg.moe.local_experts is None:
        return False
    m = _ANY_EXPERT_RE.search(name)
    return m is not None and int(m.group(1)) not in cfg.moe.expert_range


def weight_target(model: Any, name: str) -> torch.Tensor | None:
    """The view of a parameter the ironlm-named tensor `name` goes into, in the checkpoint's shape; None = not
    used by ironlm."""
    cfg = model.config
    if name == "model.embed_tokens.weight":
        return model.embed
    if name == "model.norm.weight":
        return model.norm
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings or cfg.num_labels else model.lm_head
    if name == "score.weight":
        return model.lm_head if cfg.num_labels else None
    m = LAYER_RE.match(name)
    if m is None:
        return None
    idx, rest = int(m.group(1)), m.group(2)
    if idx >= cfg.num_layers:
        return None
    layer = model.layers[idx]
    if layer.mla is not None and rest.startswith("self_attn.") and rest != "self_attn.o_proj.weight" \
            and rest != "self_attn.o_proj.bias":
        return layer.mla.weight_target(rest[10:])
    if layer.moe is not None and rest.startswith("mlp."):
        return moe_target(layer.moe, rest)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    qkv_rows = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
    if rest.startswith("self_attn.") and rest[11:] in ("_proj.weight", "_proj.bias") and rest[10] in qkv_rows:
        rows = qkv_rows[rest[10]]
        if rest.endswith("weight"):
            return layer.qkv_weight[:, rows].t()
        return None if layer.qkv_bias is None else layer.qkv_bias[rows]
    simple = {
        "input_layernorm.weight": layer.input_norm,
        "post_attn_norm.weight": layer.attn_out_norm,
        "post_attention_layernorm.weight": layer.post_norm,
        "post_mlp_norm.weight": layer.mlp_out_norm,
        "self_attn.o_proj.weight": layer.o_weight.t(),
        "self_attn.o_proj.bias": layer.o_bias,
        "self_attn.q_norm.weight": layer.q_norm,
        "self_attn.k_norm.weight": layer.k_norm,
        "self_attn.sinks": layer.sinks,
        "mlp.gate_proj.weight": layer.gate_up_weight[:, :inter].t(),
        "mlp.up_proj.weight": layer.gate_up_weight[:, inter:].t(),
        "mlp.down_proj.weight": layer.down_weight.t(),
    }
    return simple.get(rest)


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


@torch.no_grad()
def load_weight(model: Any, name: str, tensor: Any, shape: tuple[int, ...] | None = None) -> bool:
    """Copy one HF-named checkpoint tensor into place (cast to the model dtype/device); False if ironlm ignores
    it. Under tensor parallelism `tensor` is the whole weight or a safetensors slice of full `shape`, and only
    this rank's part is read and copied."""
    cfg = model.config
    name = canonical(cfg, name)
    m = LAYER_RE.match(name)
    if m is not None and stacked.is_stacked(m.group(2)):
        return _copy_stacked(model, int(m.group(1)), name, m.group(2), tensor, shape)
    split = registry.by_model_type(cfg.architecture).split
    if split is not None:
        whole = cfg if model.tp is None else model.tp.shard.config  # a fused tensor holds every rank's rows
        parts = split(whole, name, tensor[:] if shape is not None else tensor)
        if parts is not None:
            return any([_copy(model, n, t, None) for n, t in parts])  # noqa: C419 - copy every part
    return _copy(model, name, tensor, shape)


def _copy_stacked(model: Any, idx: int, name: str, rest: str, tensor: Any, shape: tuple[int, ...] | None) -> bool:
    """A MoE layer's experts stacked in one tensor (moe/stacked.py): this rank's experts, whole (expert
    parallelism splits experts, never an expert's rows)."""
    if idx >= model.config.num_layers or model.layers[idx].moe is None:
        return False
    layout = stacked.LAYOUTS[registry.by_model_type(model.config.architecture).experts_layout]
    filled = stacked.load(model.layers[idx].moe, layout, name, rest, tensor, shape)
    for n in filled:
        model.mark_loaded(f"model.layers.{idx}.{n}")
    return bool(filled)


def wanted(model: Any, name: str) -> bool:
    """Whether ironlm loads the ironlm-named tensor `name` (a stacked expert tensor has no one weight_target)."""
    m = LAYER_RE.match(name)
    return model.weight_target(name) is not None or (m is not None and stacked.is_stacked(m.group(2)))


def _copy(model: Any, name: str, tensor: Any, shape: tuple[int, ...] | None) -> bool:
    target = weight_target(model, name)
    if target is None:
        return False
    if model.tp is not None:
        tensor = model.tp.shard.take(name, tensor, tuple(tensor.shape) if shape is None else shape)
    if tuple(target.shape) != tuple(tensor.shape):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
    offset = model.config.norm_offset
    if offset and is_norm(name) and model.config.source == "hf":
        tensor = tensor.to(torch.float32) + offset
    target.copy_(tensor)
    model.mark_loaded(name)
    return True


# ---- GGUF names ---------------------------------------------------------------------------------------------
GGUF_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attn_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_mlp_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a MoE layer's router; its experts are GGUF_EXPERT_RE's
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_inp.bias": "mlp.gate.bias",  # gpt-oss's router bias
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",  # DeepSeek-V3's score-correction bias
    "attn_sinks.weight": "self_attn.sinks",
    # multi-head latent attention (DeepSeek's deepseek2): llama.cpp splits kv_b_proj per head into k_b (transposed,
    # [heads, kv_lora_rank, nope]) and v_b ([heads, v_head_dim, kv_lora_rank]); mla.py takes both as views of kv_b
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
}
# one expert of a stacked ffn_*_exps tensor (or its bias), as the GGUF loader splits them (model/moe/gguf.py)
GGUF_EXPERT_RE = re.compile(r"^ffn_(gate|up|down)_exps\.(\d+)\.(weight|bias)$")
GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf(gguf_name: str, renames: Mapping[str, str] | None = None) -> str | None:
    """GGUF tensor name -> ironlm's (HF-style) name; None: not a model weight ironlm uses. `renames` (the family's
    `gguf_renames`) overrides GGUF_LAYER_NAMES where an architecture gives a slot another meaning."""
    if gguf_name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[gguf_name]
    m = GGUF_BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    layer = (renames or {}).get(m.group(2)) or GGUF_LAYER_NAMES.get(m.group(2))
    if layer is not None:
        return f"model.layers.{m.group(1)}.{layer}"
    e = GGUF_EXPERT_RE.match(m.group(2))
    if e:
        return f"model.layers.{m.group(1)}.mlp.experts.{e.group(2)}.{e.group(1)}_proj.{e.group(3)}"
    return None
