"""DeepSeek-V2 / DeepSeek-V3 (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM): multi-head latent attention
(model/mla.py) on every layer, optionally a low-rank q (q_lora_rank), RoPE on interleaved pairs, YaRN's mscale in
the softmax scale; dense MLPs on the first `first_k_dense_replace` layers, then MoE (model/moe/): routed experts
plus one shared MLP, V2 with softmax scores (optionally group-limited by each group's best expert), V3 with sigmoid
scores, the score-correction bias and groups ranked by their best two; weights times routed_scaling_factor."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ironlm.exceptions import UnsupportedModelError
from ironlm.model.families.common import gguf_rope_scaling
from ironlm.model.moe.gguf import gguf_moe
from ironlm.model.moe.spec import MoeConfig, RouteSpec, sparse_layers
from ironlm.model.registry import Family, register


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _mla_fields(hf: Any, interleave: bool) -> dict[str, Any]:
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    q_rank = getattr(hf, "q_lora_rank", None)
    return _mla(int(hf.kv_lora_rank), None if q_rank is None else int(q_rank), int(hf.qk_nope_head_dim),
                int(hf.qk_rope_head_dim), int(hf.v_head_dim), interleave, bool(getattr(hf, "attention_bias", False)),
                params)


def _mla(rank: int, q_rank: int | None, nope: int, rope: int, v_dim: int, interleave: bool, bias: bool,
         params: dict[str, Any]) -> dict[str, Any]:
    scale = (nope + rope) ** -0.5
    if params.get("rope_type", params.get("type", "default")) not in (None, "default") and params.get("mscale_all_dim"):
        m = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m  # transformers' yarn_apply_mscale: the attention logits, not only the rotary
    return {
        "kv_lora_rank": rank, "q_lora_rank": q_rank, "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope, "v_head_dim": v_dim, "rope_interleave": interleave,
        # the cache's one latent "head" (see ModelConfig.kv_lora_rank)
        "num_kv_heads": 1, "head_dim": rank + rope, "rotary_dim": rope, "attn_scale": scale,
        "attention_bias": bias, "attention_out_bias": bias,
    }


def _moe(hf: Any, route: RouteSpec, correction: bool) -> MoeConfig:
    inter = int(hf.moe_intermediate_size)
    return MoeConfig(route=route, intermediate_size=inter,
                     sparse_layers=sparse_layers(hf.num_hidden_layers,
                                                 first_dense=int(getattr(hf, "first_k_dense_replace", 0) or 0)),
                     shared_intermediate_size=inter * int(getattr(hf, "n_shared_experts", 0) or 0),
                     correction_bias=correction)


def _v2(hf: Any) -> dict[str, Any]:
    method = getattr(hf, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedModelError(f"deepseek_v2: unsupported topk_method {method!r} (greedy, group_limited_greedy)")
    grouped = method == "group_limited_greedy"
    # softmax scores, no renormalisation (transformers' DeepseekV2TopkRouter ignores norm_topk_prob)
    route = RouteSpec(num_experts=int(hf.n_routed_experts), top_k=int(hf.num_experts_per_tok), scoring="softmax",
                      n_group=int(hf.n_group) if grouped else 1, topk_group=int(hf.topk_group) if grouped else 1,
                      group_score="max", scaling=float(hf.routed_scaling_factor))
    # transformers rotates V2's q_pe / k_pe as complex numbers: interleaved pairs
    return {**_mla_fields(hf, interleave=True), "moe": _moe(hf, route, correction=False)}


def _v3(hf: Any) -> dict[str, Any]:
    # sigmoid scores, selection by score + e_score_correction_bias within the best topk_group groups (a group scores
    # by its best two), weights from the uncorrected scores
    route = RouteSpec(num_experts=int(hf.n_routed_experts), top_k=int(hf.num_experts_per_tok), scoring="sigmoid",
                      renormalize=bool(hf.norm_topk_prob), renorm_eps=1e-20, n_group=int(hf.n_group or 1),
                      topk_group=int(hf.topk_group or 1), group_score="top2_sum",
                      scaling=float(hf.routed_scaling_factor))
    return {**_mla_fields(hf, interleave=bool(getattr(hf, "rope_interleave", True))),
            "moe": _moe(hf, route, correction=True)}


_GATING = {1: "softmax", 2: "sigmoid"}  # gguf's ExpertGatingFuncType


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    """llama.cpp's ``deepseek2`` (V2 and V3 alike). The converter writes ``expert_gating_func`` only when the HF
    config names a scoring function, which transformers' DeepseekV3Config does not keep: without the key a file
    with the score-correction bias (``exp_probs_b``, V3's alone) is V3 (sigmoid), any other V2 (softmax, llama.cpp's
    default). Groups rank by their best expert under softmax (V2's group_limited_greedy) and by their best two
    under sigmoid (V3), as transformers does; llama.cpp's graph ranks by the best two in both."""
    n = int(meta("block_count"))
    rank, rope = int(meta("attention.kv_lora_rank")), int(meta("rope.dimension_count"))
    q_rank = meta("attention.q_lora_rank")
    params = dict(gguf_rope_scaling(meta) or {})
    log_mul = meta("rope.scaling.yarn_log_multiplier")
    if params.get("rope_type") == "yarn" and log_mul:
        # the converter stores 0.1 * mscale_all_dim; llama.cpp's graph takes mscale = mscale_all_dim (V3's own)
        params["mscale"] = params["mscale_all_dim"] = float(log_mul) / 0.1
    fields = _mla(rank, None if q_rank is None else int(q_rank), int(meta("attention.key_length_mla")) - rope, rope,
                  int(meta("attention.value_length_mla")), True, "blk.0.attn_kv_a_mqa.bias" in gf.tensors, params)
    moe = gguf_moe(meta, gf, "deepseek2", n)
    if moe is None:
        return {**fields, "rope_scaling": params or None, "architecture": "deepseek_v2"}
    correction = any(name.endswith(".exp_probs_b.bias") for name in gf.tensors)
    gating = meta("expert_gating_func")
    if gating is not None and int(gating) not in _GATING:
        raise UnsupportedModelError(f"deepseek2 GGUF: unsupported expert_gating_func {gating} (1 softmax, 2 sigmoid)")
    scoring = _GATING[int(gating)] if gating is not None else ("sigmoid" if correction else "softmax")
    sigmoid = scoring == "sigmoid"
    route = dataclasses.replace(moe.route, scoring=scoring, n_group=int(meta("expert_group_count", 1) or 1),
                                topk_group=int(meta("expert_group_used_count", 1) or 1),
                                group_score="top2_sum" if sigmoid else "max", renorm_eps=1e-20 if sigmoid else 0.0)
    return {**fields, "rope_scaling": params or None, "architecture": "deepseek_v3" if sigmoid else "deepseek_v2",
            "moe": dataclasses.replace(moe, route=route, correction_bias=correction)}


# DeepSeek's shared experts are one MLP of n_shared_experts * moe_intermediate_size (MoeBlock's shared expert)
_RENAMES = {f"mlp.shared_experts.{x}_proj.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}


_FEATURES = ("multi-head latent attention (latent KV cache, absorbed up-projections)", "low-rank q (q_lora_rank)",
             "routed + shared experts, group-limited top-k", "dense first layers (first_k_dense_replace)")

DEEPSEEK_V2 = register(Family(
    name="deepseek_v2",
    hf_classes=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    features=_FEATURES + ("softmax router",),
    hf_fields=_v2,
    hf_renames=_RENAMES,
))

DEEPSEEK_V3 = register(Family(
    name="deepseek_v3",
    hf_classes=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    gguf_archs=("deepseek2",),  # V2 files too: `_gguf` names the architecture from the router
    features=_FEATURES + ("sigmoid router with score-correction bias",),
    hf_fields=_v3,
    gguf_fields=_gguf,
    hf_renames=_RENAMES,
))
