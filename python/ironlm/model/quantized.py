"""Quantized storage for a loaded decoder: its linears become block-quantized (the core's QuantMatrix on CPU,
Triton int8/int4 or fp8 on GPU) and their dense parameters are dropped. Which spec applies is decided elsewhere
(quantize.py resolves it, the loaders pass GGUF blocks through); this module only installs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ironlm import _core
from ironlm.model.linear import QuantizedLinear, QuantLinear
from ironlm.model.quantize import QuantSpec, from_float


def _empty(model: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty((0,), dtype=model.dtype, device=model.device), requires_grad=False)


def quantize_core(model: Any, spec: QuantSpec, parts: dict[str, _core.QuantMatrix] | None = None) -> None:
    """The core's QuantMatrix linears; `parts` are HF-named matrices a loader built from the file's own blocks
    (GGUF); without them the loaded dense weights are quantized."""
    cfg = model.config
    parts = parts or {}

    def mat(name: str, dense: torch.Tensor) -> _core.QuantMatrix:
        return parts[name] if name in parts else from_float(dense, spec)

    for i, module in enumerate(model.layers):
        layer = module
        p, inter = f"model.layers.{i}.", cfg.intermediate_size
        w = layer.qkv_weight.t()  # [q + 2kv, h]
        q, kv = cfg.q_size, cfg.kv_size
        qkv = [mat(p + "self_attn.q_proj.weight", w[:q]), mat(p + "self_attn.k_proj.weight", w[q:q + kv]),
               mat(p + "self_attn.v_proj.weight", w[q + kv:])]
        layer.qkv = QuantLinear(_core.QuantMatrix.concat(qkv), layer.qkv_bias)
        layer.o = QuantLinear(mat(p + "self_attn.o_proj.weight", layer.o_weight.t()), layer.o_bias)
        if layer.moe is not None:
            def make(pieces: list[tuple[str, torch.Tensor]], bias: torch.Tensor | None, p: str = p) -> QuantLinear:
                return QuantLinear(_core.QuantMatrix.concat([mat(p + n, w) for n, w in pieces]), bias)

            layer.moe.quantize_(make)
        else:
            gu = layer.gate_up_weight.t()
            gate_up = [mat(p + "mlp.gate_proj.weight", gu[:inter]), mat(p + "mlp.up_proj.weight", gu[inter:])]
            layer.gate_up = QuantLinear(_core.QuantMatrix.concat(gate_up))
            layer.down = QuantLinear(mat(p + "mlp.down_proj.weight", layer.down_weight.t()))
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            setattr(layer, name, _empty(model))
    if cfg.tie_word_embeddings:
        model.head = model.embed_q = QuantLinear(mat("model.embed_tokens.weight", model.embed))
    else:
        model.head = QuantLinear(mat("lm_head.weight", model.lm_head))
        model.embed_q = QuantLinear(mat("model.embed_tokens.weight", model.embed))
        model.lm_head = _empty(model)
    model.embed = _empty(model)
    if cfg.tie_word_embeddings:
        model.lm_head = model.embed
    model.quant = spec


def quantize_gpu(model: Any, spec: QuantSpec) -> None:
    """int8/int4 (Triton) or fp8 (`_scaled_mm`) linears from the loaded dense weights, fused ones kept fused."""
    from ironlm.model.linear_gpu import Fp8Linear, TritonQuantLinear

    def make(weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedLinear:
        if spec.backend == "fp8":
            return Fp8Linear.from_float(weight, bias)
        return TritonQuantLinear.from_float(weight, spec.bits, spec.group_size, bias)

    for module in model.layers:
        layer = module
        layer.qkv = make(layer.qkv_weight.t(), layer.qkv_bias)
        layer.o = make(layer.o_weight.t(), layer.o_bias)
        if layer.moe is not None:
            layer.moe.quantize_(lambda pieces, bias: make(torch.cat([w for _, w in pieces]), bias))
        else:
            layer.gate_up = make(layer.gate_up_weight.t())
            layer.down = make(layer.down_weight.t())
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            setattr(layer, name, _empty(model))
    head = make(model.embed if model.config.tie_word_embeddings else model.lm_head)
    model.head = head
    model.embed_q = head if model.config.tie_word_embeddings else make(model.embed)
    model.embed = model.lm_head = _empty(model)
    model.quant = spec
