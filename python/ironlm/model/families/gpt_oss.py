"""gpt-oss: every layer a MoE (router with a bias, top-k of the logits then a softmax over those k, experts with
biases and a clamped SwiGLU), attention with q/k/v/o biases and a learned sink per head, sliding windows on every
other layer (128 tokens in the released models), YaRN RoPE.

Its checkpoints stack the experts: ``mlp.experts.gate_up_proj`` ``[E, hidden, 2I]`` with gate and up columns
interleaved (gate = even columns), ``down_proj`` ``[E, I, hidden]``, both already ``[in, out]``, and the biases
``gate_up_proj_bias`` ``[E, 2I]`` (interleaved alike) and ``down_proj_bias`` ``[E, hidden]``: moe/stacked.py's
``gpt_oss`` layout, which de-interleaves gate from up as it copies them into the MoE block.

GGUF (llama.cpp's ``gpt-oss``): the converter de-interleaves and stacks the experts (``ffn_*_exps`` weights and
biases, moe/gguf.py splits them), names the pre-MLP norm ``post_attention_norm`` and writes neither the SwiGLU
alpha/limit nor the window pattern nor YaRN's truncate: llama.cpp's graph fixes them (alpha 1.702, limit 7.0 unless
``swiglu_clamp_exp`` says otherwise, every even layer sliding, untruncated YaRN), and so does `_gguf`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ironlm.exceptions import UnsupportedModelError
from ironlm.model.families.common import gguf_rope_scaling, layer_types_window
from ironlm.model.moe.gguf import gguf_moe
from ironlm.model.moe.spec import MoeConfig, RouteSpec
from ironlm.model.registry import Family, register


def _hf(hf_config: Any) -> dict[str, Any]:
    n = hf_config.num_hidden_layers
    experts = int(hf_config.num_local_experts)
    bias = bool(getattr(hf_config, "attention_bias", True))
    return {
        "attention_bias": bias,
        "attention_out_bias": bias,
        "attn_sinks": True,
        "swiglu_clamp": (float(hf_config.swiglu_alpha), float(hf_config.swiglu_limit)),
        "moe": MoeConfig(route=RouteSpec(experts, int(hf_config.num_experts_per_tok), scoring="topk_softmax"),
                         intermediate_size=int(hf_config.intermediate_size), sparse_layers=(True,) * n,
                         router_bias=True, expert_bias=True),
        **layer_types_window(hf_config),
    }


# llama.cpp's gpt-oss graph (swiglu_oai): the released models' values, which GGUF files do not carry
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


def _gguf(meta: Any, gf: Any) -> dict[str, Any]:
    n = int(meta("block_count"))
    moe = gguf_moe(meta, gf, "gpt-oss", n)
    if moe is None:
        raise UnsupportedModelError("gpt-oss GGUF without expert_count")
    limit = meta("swiglu_clamp_exp", SWIGLU_LIMIT)
    if isinstance(limit, np.ndarray):  # per-layer values: one clamp for every layer only
        if len(set(limit.tolist())) != 1:
            raise UnsupportedModelError(f"per-layer swiglu_clamp_exp {limit.tolist()} is not supported")
        limit = limit[0]
    window = meta("attention.sliding_window")
    scaling = gguf_rope_scaling(meta)
    return {
        "attn_sinks": True,
        "swiglu_clamp": (SWIGLU_ALPHA, float(limit)),
        "moe": dataclasses.replace(moe, route=dataclasses.replace(moe.route, scoring="topk_softmax"),
                                   router_bias=True, expert_bias=True),
        **({} if not window else {"sliding_window": int(window), "sliding_layers": [i % 2 == 0 for i in range(n)]}),
        **({} if scaling is None or scaling["rope_type"] != "yarn" else {"rope_scaling": {**scaling,
                                                                                          "truncate": False}}),
    }


GPT_OSS = register(Family(
    name="gpt_oss",
    hf_classes=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    gguf_archs=("gpt-oss",),
    features=("mixture of experts: top-k of the logits then softmax, router bias, expert biases",
              "clamped SwiGLU (swiglu_alpha, swiglu_limit)", "attention sinks", "q/k/v/o biases",
              "alternating sliding / full layers (layer_types)", "YaRN RoPE"),
    hf_fields=_hf,
    hf_renames={"mlp.router.weight": "mlp.gate.weight", "mlp.router.bias": "mlp.gate.bias"},
    experts_layout="gpt_oss",
    gguf_fields=_gguf,
    gguf_renames={"post_attention_norm.weight": "post_attention_layernorm.weight"},  # gpt-oss: the pre-MLP norm
))
